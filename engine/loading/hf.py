"""Hugging Face checkpoint directories: ``config.json`` + safetensors weights, as a TensorSource.

Accepted layouts::

    model.safetensors                                   one file
    model.safetensors.index.json + model-0000k-of-0000n.safetensors   sharded; the index's
        {"weight_map": {tensor_name: shard_file}} must name existing shards (plain file names
        inside the directory) and every listed tensor must be in its shard

Pickle checkpoints (``pytorch_model.bin``, ``*.pt``, ``*.pth``) are refused, never unpickled:
``torch.load`` can execute code (CVE-2025-32434 bypassed even ``weights_only=True``).

MoE expert layouts: transformers 5 *saves* routed experts one tensor per expert
(Mixtral ``block_sparse_moe.experts.{j}.w1/w3/w2.weight``,
Qwen ``mlp.experts.{j}.{gate,up,down}_proj.weight``),
which the architecture's ``canonical_name`` maps. Its in-memory modules (and some checkpoints)
hold them fused per layer instead::

    mlp.experts.gate_up_proj   [E, 2*I, H]   rows [0, I) are gate (w1), rows [I, 2I) are up (w3):
                                             forward does ``linear(x, W[j]).chunk(2, dim=-1)`` -> gate, up
    mlp.experts.down_proj      [E, H, I]

(``block_sparse_moe.experts.*`` for Mixtral too). Those are split here into per-expert canonical
names, each a zero-copy slice of the mapped file.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.configio.fields import first_present
from engine.configio.hf import config_from_hf_dir_raw
from engine.errors import ModelFormatError, quote
from engine.loading.paths import confine
from engine.loading.safetensors import SafetensorsFile
from engine.loading.source import TensorInfo, TensorSource, expert_name
from engine.loading.validate import CountFields
from engine.models.registry import get_spec

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_INDEX_BYTES = 64 * 1024 * 1024  # a 100k-tensor index is a few MB

# A fused expert tensor (with or without a trailing ".weight").
_FUSED_RE = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$"
)


@dataclass(frozen=True)
class _Ref:
    """Where a canonical tensor lives: file, stored name, and an optional expert slice."""

    file: SafetensorsFile
    stored_name: str
    expert: int | None = None  # index into dim 0 of a fused [E, ...] tensor
    rows: tuple[int, int] | None = None  # [lo, hi) along dim 1 after taking ``expert``
    shape: tuple[int, ...] = ()
    dtype: str = ""
    load: object = None  # ArchSpec.hf_split: a zero-argument function reading the tensor


class HFSource(TensorSource):
    """Tensors of a Hugging Face checkpoint directory under canonical names (lazy, zero-copy)."""

    def __init__(self, path: str | Path) -> None:
        root = Path(path)
        self.path = str(root)
        if not root.is_dir():
            raise ModelFormatError(root, "not a directory; expected a Hugging Face checkpoint directory")
        self.config, raw = config_from_hf_dir_raw(root)
        self.count_fields = CountFields(
            str(root / "config.json"), first_present(raw, "num_hidden_layers"),
            first_present(raw, "num_experts", "num_local_experts"))
        self._spec = get_spec(self.config.arch)
        self._files: dict[str, SafetensorsFile] = {}
        self._refs: dict[str, _Ref] = {}
        try:
            located = self._locate(root)  # {stored tensor name: SafetensorsFile}
            self._located = located
            for stored, f in located.items():
                self._add(stored, f)
        except BaseException:
            self.close()
            raise

    # ---- discovery -------------------------------------------------------------------------
    def _open(self, file: Path) -> SafetensorsFile:
        key = file.name
        if key not in self._files:
            self._files[key] = SafetensorsFile(file)
        return self._files[key]

    def _locate(self, root: Path) -> dict[str, SafetensorsFile]:
        index = confine(root, INDEX_FILE)
        single = confine(root, SINGLE_FILE)
        if index.is_file():
            return self._read_index(root, index)
        if single.is_file():
            f = self._open(single)
            return {n: f for n in f.names()}
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ModelFormatError(
                root / pickles[0],
                "pickle checkpoints (.bin/.pt) are refused because loading them can execute "
                "arbitrary code; convert the checkpoint to safetensors (e.g. transformers "
                "`save_pretrained(..., safe_serialization=True)` in a sandbox)",
            )
        raise ModelFormatError(root, f"no {SINGLE_FILE} or {INDEX_FILE} in the directory")

    def _read_index(self, root: Path, index: Path) -> dict[str, SafetensorsFile]:
        size = index.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise ModelFormatError(index, f"index is {size} bytes, over the {MAX_INDEX_BYTES}-byte limit")
        try:
            raw = json.loads(index.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ModelFormatError(index, f"not valid UTF-8 (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise ModelFormatError(index, f"not valid JSON: {e.msg} at line {e.lineno} "
                                          f"column {e.colno}") from None
        except RecursionError:
            raise ModelFormatError(index, "not valid JSON: nested too deeply") from None
        wmap = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise ModelFormatError(index, "missing or empty 'weight_map' object")
        located: dict[str, SafetensorsFile] = {}
        for name, shard in wmap.items():
            # Shard names must be plain files in the directory: no "../x", no absolute paths.
            if (not isinstance(shard, str) or not shard or Path(shard).name != shard
                    or shard in (".", "..")):
                raise ModelFormatError(
                    index, f"tensor {quote(name)} maps to invalid shard name {quote(shard)}")
            shard_path = confine(root, shard, named_by=index)  # a symlink may not leave root
            if not shard_path.is_file():
                raise ModelFormatError(
                    index, f"tensor {quote(name)} maps to shard {quote(shard)}, which does not exist")
            f = self._open(shard_path)
            if name not in f:
                raise ModelFormatError(
                    shard_path, f"index {INDEX_FILE} lists tensor {quote(name)} in this shard but it "
                                "is not there")
            located[name] = f
        for f in self._files.values():
            extra = [n for n in f.names() if n not in located]
            if extra:
                log.debug("%s: %d tensors not listed in the index ignored (e.g. %s)",
                          f.path, len(extra), extra[0])
        return located

    def _put(self, canonical: str, ref: _Ref) -> None:
        if canonical in self._refs:
            other = self._refs[canonical]
            raise ModelFormatError(
                ref.file.path,
                f"tensor {quote(ref.stored_name)} and tensor {quote(other.stored_name)} (in {other.file.path}) "
                f"both map to {quote(canonical)}")
        self._refs[canonical] = ref

    def _add(self, stored: str, f: SafetensorsFile) -> None:
        shape, dtype = f.info(stored)
        if self._spec.hf_split is not None:
            parts = self._spec.hf_split(stored, shape, dtype, self._stored_get, self.config)
            if parts is not None:  # the architecture splits (or pairs up) this stored tensor
                for canonical, pshape, pdtype, load in parts:
                    self._put(canonical, _Ref(f, stored, shape=tuple(pshape), dtype=pdtype, load=load))
                return
        m = _FUSED_RE.match(stored)
        if m is None:
            self._put(self._spec.canonical_name(stored), _Ref(f, stored, shape=shape, dtype=dtype))
            return
        layer, kind = int(m.group(1)), m.group(2)
        if len(shape) != 3:
            raise ModelFormatError(
                f.path, f"fused expert tensor {quote(stored)} must be 3-D [E, out, in], got {list(shape)}")
        n_exp, out, inner = shape
        self._check_fused_experts(f, stored, shape)
        if kind == "gate_up_proj":
            if out % 2:
                raise ModelFormatError(
                    f.path,
                    f"fused tensor {quote(stored)} has shape {list(shape)}; dim 1 must be 2*I (gate then up)")
            half = out // 2
            for j in range(n_exp):
                self._put(expert_name(layer, j, "gate_proj"),
                          _Ref(f, stored, j, (0, half), (half, inner), dtype))
                self._put(expert_name(layer, j, "up_proj"),
                          _Ref(f, stored, j, (half, out), (half, inner), dtype))
        else:  # down_proj [E, H, I]
            for j in range(n_exp):
                self._put(expert_name(layer, j, "down_proj"), _Ref(f, stored, j, None, (out, inner), dtype))

    def _check_fused_experts(self, f: SafetensorsFile, stored: str, shape: tuple[int, ...]) -> None:
        """A fused [E, out, in] tensor is split into E per-expert entries: E must be the
        config's expert count and every expert must hold data, so the split is bounded by the
        file (a zero-size [10^9, 0, 0] tensor costs no bytes but would make 10^9 entries)."""
        moe = self.config.moe
        if 0 in shape:
            raise ModelFormatError(f.path, f"fused expert tensor {quote(stored)} has shape "
                                           f"{list(shape)}; no dimension may be zero")
        if moe is None or shape[0] != moe.num_experts:
            declared = "no experts" if moe is None else f"{moe.num_experts} experts"
            raise ModelFormatError(
                f.path, f"fused expert tensor {quote(stored)} holds {shape[0]} experts but "
                        f"config.json declares {declared}")

    def get_quantized(self, name: str, fmt) -> object | None:
        """``name`` as a QuantizedTensor in ``fmt`` without re-quantizing, when the checkpoint
        holds it in that format (gpt-oss MXFP4 experts), else None (the caller quantizes get())."""
        quantized = getattr(self._ref(name).load, "quantized", None)
        return quantized() if quantized is not None and quantized.fmt == fmt else None

    def _stored_get(self, stored: str) -> torch.Tensor:
        """A tensor by its stored name (for ArchSpec.hf_split loaders); KeyError if absent."""
        return self._located[stored].get(stored)

    # ---- TensorSource ----------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._refs)

    def __contains__(self, name: str) -> bool:
        return name in self._refs

    def _ref(self, name: str) -> _Ref:
        try:
            return self._refs[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a tensor of {self.path}") from None

    def info(self, name: str) -> TensorInfo:
        r = self._ref(name)
        return TensorInfo(name=name, shape=r.shape, dtype=r.dtype)

    def file_of(self, name: str) -> str:
        """Path of the file holding ``name`` (for error messages)."""
        return self._ref(name).file.path

    def stored_name(self, name: str) -> str:
        """The tensor's name as written in the file."""
        return self._ref(name).stored_name

    def get(self, name: str) -> torch.Tensor:
        """The tensor in its stored dtype. A zero-copy view of the file's copy-on-write mapping
        (writes never reach the file); see SafetensorsFile.get."""
        r = self._ref(name)
        if r.load is not None:
            return r.load()
        t = r.file.get(r.stored_name)
        if r.expert is not None:
            t = t[r.expert]  # [out, in] of one expert; contiguous (a dim-0 slice)
            if r.rows is not None:
                t = t[r.rows[0]:r.rows[1]]  # still contiguous: whole rows of a row-major matrix
        return t

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __repr__(self) -> str:
        return f"HFSource({self.path!r}, arch={self.config.arch}, {len(self._refs)} tensors)"
