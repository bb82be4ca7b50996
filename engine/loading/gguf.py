"""A GGUF file (engine.loading.gguf_file reads and validates it: layout, bounds, alignment)
exposed as a :class:`TensorSource`: GGUF tensor names mapped to canonical ones (the generic
llama.cpp names here, an architecture's own through ArchSpec.gguf_split), the ModelConfig from
its metadata (engine.configio.gguf). :meth:`GGUFSource.get` returns tensors that own their
memory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.configio.gguf import config_from_gguf_metadata
from engine.errors import ConfigError, ModelFormatError, quote
from engine.loading.gguf_file import (_INT_TYPES, _TYPE_NAMES, SPECIAL_TOKEN_KEYS, T_ARRAY, GGUFFile,
                                      GGUFTensorInfo)
from engine.loading.gguf_quants import GGMLType, can_dequantize, dequantize
from engine.loading.source import TensorInfo, TensorSource, expert_name
from engine.loading.validate import CountFields
from engine.models.registry import get_spec

__all__ = ["GGUFFile", "GGUFSource", "GGUFTensorInfo"]  # GGUFFile: engine.loading.gguf_file


# ---- GGUF name -> canonical name ----------------------------------------------------------------
# Per-layer components: GGUF "blk.N.<component>.<weight|bias>" -> canonical suffix after
# "model.layers.N.".
_LAYER_COMPONENTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_STACKED_EXPERTS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_SPLIT_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")


@dataclass(frozen=True)
class _Entry:
    gguf_name: str
    shape: tuple[int, ...]  # canonical logical shape
    expert: int | None = None  # index into a stacked [E, out, in] tensor
    unpermute_heads: int = 0  # >0: undo llama.cpp's q/k row permutation with this many heads
    load: object = None  # ArchSpec.gguf_split: load(source) builds the tensor (e.g. from two)


class GGUFSource(TensorSource):
    """A GGUF file's tensors under canonical names (see engine.loading.source).

    ``metadata`` is the parsed key/value dict, ``config`` the :class:`ModelConfig` built from it,
    ``tensor_infos`` the raw per-GGUF-name :class:`GGUFTensorInfo` map, ``unmapped`` the GGUF
    tensor names with no canonical counterpart (e.g. ``rope_freqs.weight``), which are not
    served by :meth:`get`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(Path(path))
        from engine.loading.gguf_split import open_gguf

        self._file = open_gguf(self.path)  # one file, or every shard of a split model
        try:
            self.metadata: dict[str, Any] = self._file.metadata
            self.tensor_infos: dict[str, GGUFTensorInfo] = self._file.tensors
            meta = dict(self.metadata)
            meta["_tied_embeddings"] = "output.weight" not in self.tensor_infos
            meta["_attention_bias"] = "blk.0.attn_q.bias" in self.tensor_infos
            if "rope_freqs.weight" in self.tensor_infos:
                # Llama 3.x GGUFs carry their rope scaling as per-frequency divisors in a tensor,
                # not as metadata; the config applies them to the inverse frequencies.
                meta["_rope_freq_factors"] = self._rope_freq_factors()
            self._check_vocabulary()
            try:
                self.config: ModelConfig = config_from_gguf_metadata(meta, source=self.path)
            except ConfigError as e:  # a value out of range: name the file it came from
                raise self._fail(str(e)) from None
            except (ArithmeticError, AttributeError, KeyError) as e:
                # config_from_gguf_metadata maps TypeError/ValueError itself; a zero head count or a
                # value of an unexpected kind can still escape as these.
                raise self._fail(f"bad metadata value ({type(e).__name__}): {quote(str(e), 80)}") from None
            garch = self.metadata.get("general.architecture")
            self.count_fields = CountFields(self.path, f"{garch}.block_count", f"{garch}.expert_count")
            self._entries: dict[str, _Entry] = {}
            self.unmapped: list[str] = []
            self._build_entries()
        except BaseException:
            self._file.close()
            raise

    def _check_vocabulary(self) -> None:
        """The tokenizer's token list must match the embedding rows one to one (as llama.cpp
        requires): with fewer tokens the model can generate ids nothing decodes, with more the
        tokenizer can produce ids the embedding has no row for. Special-token ids must be
        integers inside the vocabulary."""
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if tokens is not None and (self.metadata_type("tokenizer.ggml.tokens") != T_ARRAY
                                   or not all(isinstance(t, str) for t in tokens)):
            raise self._fail("tokenizer.ggml.tokens must be an array of strings")
        embd = self.tensor_infos.get("token_embd.weight")
        rows = embd.shape[0] if embd is not None else None
        if tokens is not None and rows is not None and len(tokens) != rows:
            raise self._fail(
                f"the tokenizer has {len(tokens)} tokens (tokenizer.ggml.tokens) but the "
                f"embedding token_embd.weight has {rows} rows; they must be equal, or the model "
                "produces ids the tokenizer cannot decode (or the reverse)")
        vocab = len(tokens) if tokens is not None else rows
        for key in SPECIAL_TOKEN_KEYS:
            if key not in self.metadata:
                continue
            value = self.metadata[key]
            if self.metadata_type(key) not in _INT_TYPES:
                raise self._fail(f"{key} must be an integer, got a "
                                 f"{_TYPE_NAMES[self.metadata_type(key)]}")
            if vocab is not None and not 0 <= value < vocab:
                raise self._fail(f"{key} {value} is outside the vocabulary ({vocab} tokens)")

    def metadata_type(self, key: str) -> int:
        """GGUF value type id of a metadata key."""
        return self._file.metadata_types[key]

    def _rope_freq_factors(self) -> list[float]:
        from engine.loading.gguf_quants import dequantize

        info = self.tensor_infos["rope_freqs.weight"]
        if len(info.shape) != 1 or info.n_elements > 4096:
            raise self._fail(f"rope_freqs.weight has shape {list(info.shape)}; expected [head_dim / 2]")
        return dequantize(self._file.raw("rope_freqs.weight"), info.type.id, info.n_elements).tolist()

    def _fail(self, problem: str) -> ModelFormatError:
        return ModelFormatError(self.path, problem)

    def _add(self, canonical: str, entry: _Entry) -> None:
        if canonical in self._entries:
            raise self._fail(f"tensors {self._entries[canonical].gguf_name!r} and "
                             f"{entry.gguf_name!r} both map to {canonical!r}")
        self._entries[canonical] = entry

    def _build_entries(self) -> None:
        cfg = self.config
        spec = get_spec(cfg.arch)
        permuted, own_split = spec.gguf_qk_permuted, spec.gguf_split
        for gname, t in self.tensor_infos.items():
            shape = t.shape
            own = own_split(gname, shape, cfg) if own_split is not None else None
            if own is not None:  # names of an architecture with its own layers
                for canonical, cshape, expert, *load in own:
                    self._add(canonical, _Entry(gname, tuple(cshape), expert=expert,
                                                load=load[0] if load else None))
                continue
            if gname in _GLOBAL_NAMES:
                self._add(_GLOBAL_NAMES[gname], _Entry(gname, shape))
                continue
            m = _STACKED_EXPERTS_RE.match(gname)
            if m:
                layer, proj = int(m.group(1)), f"{m.group(2)}_proj"
                if len(shape) != 3:
                    raise self._fail(f"stacked expert tensor {gname!r} has shape {list(shape)}; "
                                     "expected [experts, out, in]")
                n_exp = shape[0]
                if cfg.moe is None:
                    raise self._fail(f"stacked expert tensor {gname!r} holds {n_exp} experts but "
                                     "the metadata declares no expert_count")
                if n_exp != cfg.moe.num_experts:
                    raise self._fail(f"stacked expert tensor {gname!r} holds {n_exp} experts; "
                                     f"metadata says expert_count={cfg.moe.num_experts}")
                for j in range(n_exp):
                    self._add(expert_name(layer, j, proj), _Entry(gname, shape[1:], expert=j))
                continue
            m = _SPLIT_EXPERT_RE.match(gname)
            if m:
                layer, proj, j = int(m.group(1)), f"{m.group(2)}_proj", int(m.group(3))
                self._add(expert_name(layer, j, proj), _Entry(gname, shape))
                continue
            m = _LAYER_RE.match(gname)
            if m and m.group(2) in _LAYER_COMPONENTS:
                layer, comp, kind = int(m.group(1)), m.group(2), m.group(3)
                canonical = f"model.layers.{layer}.{_LAYER_COMPONENTS[comp]}.{kind}"
                heads = 0
                if permuted and comp in ("attn_q", "attn_k"):
                    heads = cfg.num_heads if comp == "attn_q" else cfg.num_kv_heads
                    rows = shape[0]
                    if rows % (2 * heads):
                        raise self._fail(f"{gname!r} has {rows} rows, not a multiple of "
                                         f"2 x {heads} heads; cannot undo the rope permutation")
                if comp == "ffn_gate_inp_shexp":
                    # Written as [H] by llama.cpp's converter (or [1, H]); canonical is [1, H].
                    if t.n_elements != shape[-1]:
                        raise self._fail(f"{gname!r} has shape {list(shape)}; expected [H] or [1, H]")
                    shape = (1, shape[-1])
                self._add(canonical, _Entry(gname, shape, unpermute_heads=heads))
                continue
            self.unmapped.append(gname)

    # ---- TensorSource -------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def info(self, name: str) -> TensorInfo:
        e = self._entries[name]
        return TensorInfo(name=name, shape=e.shape, dtype=self.tensor_infos[e.gguf_name].type.name)

    def get(self, name: str) -> torch.Tensor:
        e = self._entries[name]  # KeyError for unknown names, as the ABC specifies
        if e.load is not None:
            return e.load(self)
        t = self.tensor_infos[e.gguf_name]
        if e.expert is None:
            start, stop = 0, t.n_bytes
        else:
            # One expert of a stacked [E, out, in] tensor is a contiguous run of whole rows, and
            # rows are whole blocks, so its bytes are exactly 1/E of the tensor's.
            per = t.n_bytes // t.shape[0]
            start, stop = e.expert * per, (e.expert + 1) * per
        n = 1
        for d in e.shape:
            n *= d
        raw = self._file.raw(e.gguf_name, start, stop)
        try:
            out = self._decode(raw, t.type, n, name)
        finally:
            del raw  # drop the mmap view so close() can unmap
        out = out.reshape(e.shape)
        if e.unpermute_heads:
            out = _unpermute_rope_rows(out, e.unpermute_heads)
        return out

    def raw(self, name: str) -> tuple[np.ndarray, GGMLType]:
        """The stored bytes of a canonical tensor, undecoded: (uint8 [*shape[:-1], row_bytes], type).

        Lets a converter keep GGUF quantization (e.g. copy one expert's Q4_K blocks into the
        expert store) without a dequantize/requantize round trip. Rows are whole blocks, so the
        llama q/k rope unpermute is applied to the rows of bytes. The array owns its memory."""
        e = self._entries[name]
        t = self.tensor_infos[e.gguf_name]
        per = t.n_bytes // t.shape[0] if e.expert is not None else t.n_bytes
        start = per * e.expert if e.expert is not None else 0
        view = self._file.raw(e.gguf_name, start, start + per)
        rows = view.copy().reshape(*e.shape[:-1], -1)
        del view
        if e.unpermute_heads:
            rows = _unpermute_rope_rows(torch.from_numpy(rows), e.unpermute_heads).numpy()
        return rows, t.type

    def stored_tensor(self, gguf_name: str) -> torch.Tensor:
        """A tensor by its GGUF name, decoded to float (for ArchSpec.gguf_split loaders that
        build one canonical tensor from several stored ones)."""
        t = self.tensor_infos[gguf_name]
        raw = self._file.raw(gguf_name)
        try:
            return self._decode(raw, t.type, t.n_elements, gguf_name).reshape(t.shape)
        finally:
            del raw

    def get_quantized(self, name: str, fmt) -> object | None:
        """``name`` as a QuantizedTensor in ``fmt`` without re-quantizing, when it is stored in
        that format (GGML MXFP4 -> the ``mxfp4`` store format: the same values; the nibbles are
        reordered from ggml's j | j+16 pairs to 2j | 2j+1), else None."""
        e = self._entries[name]
        if fmt.name != "mxfp4" or self.tensor_infos[e.gguf_name].type.name != "mxfp4" or len(e.shape) != 2:
            return None
        from engine.quant.formats import QuantizedTensor

        rows, _ = self.raw(name)  # uint8 [out, in/32 * 17]
        out, inp = e.shape
        blocks = torch.from_numpy(rows).reshape(out, inp // 32, 17)
        qs = blocks[:, :, 1:]
        codes = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # [out, G, 32] in weight order
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(out, inp // 2).contiguous()
        return QuantizedTensor(fmt, (out, inp), {"codes": packed, "scales": blocks[:, :, 0].contiguous()})

    def _decode(self, raw: np.ndarray, gtype: GGMLType, n: int, name: str) -> torch.Tensor:
        if gtype.name == "f32":
            return torch.from_numpy(raw.view("<f4").copy())
        if gtype.name == "f16":
            return torch.from_numpy(raw.view("<f2").copy())
        if gtype.name == "bf16":
            return torch.from_numpy(raw.view("<i2").copy()).view(torch.bfloat16)
        if not can_dequantize(gtype.id):
            raise self._fail(f"tensor {name!r} is stored as ggml type {gtype.name}, which moestream "
                             "cannot dequantize")
        return torch.from_numpy(dequantize(raw, gtype.id, n))

    def close(self) -> None:
        self._file.close()


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation (convert_hf_to_gguf ``LlamaModel.permute``).

    HF keeps each head's rows as [2, D/2] (the two rotate_half halves); llama.cpp rewrites them
    as [D/2, 2] (interleaved pairs, ggml's "normal" rope). So the file's rows, viewed as
    [n_heads, D/2, 2, ...], are transposed back to [n_heads, 2, D/2, ...]. Works for weights
    [rows, H] and biases [rows].
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
