"""Checks shared by the tests of GGUFs written by llama.cpp's own converter
(test_qwen3_next_gguf.py, test_qwen3_5_moe_gguf.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from engine.executor import executor_for
from engine.generate import generate_ids
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model

_CONVERTER = Path(__file__).resolve().parents[3] / "bench" / "llama_cpp_converter.py"


def converter_module():
    """bench/llama_cpp_converter.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("llama_cpp_converter", _CONVERTER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def all_logits(model, ids) -> torch.Tensor:
    """[len(ids), vocab] logits of one prefill of ``ids`` (through the executor, as serving runs it)."""
    cfg = model.config
    ids = torch.as_tensor(ids)
    return executor_for(model)(ids, BatchLayout.single(0, len(ids), 0),
                               ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), all_logits=True)


def assert_matches_transformers(ref, gguf_path: Path, hf_dir: Path, max_tokens: int):
    """The GGUF's model: logits over 150 positions (longer than one DeltaNet chunk) equal to
    transformers' ``ref``, and ``max_tokens`` greedy tokens equal to the HF directory's. Returns
    the model."""
    files = open_model_files(gguf_path)
    model = build_model(files.config, files.source)
    prompt = torch.randint(3, files.config.vocab_size, (150,), generator=torch.Generator().manual_seed(2))
    got = all_logits(model, prompt)
    with torch.no_grad():
        want = ref(prompt[None]).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    hf_files = open_model_files(hf_dir)
    hf_model = build_model(hf_files.config, hf_files.source)
    sampling = SamplingConfig(max_tokens=max_tokens, ignore_eos=True)
    tokens = [t for t, _, _ in generate_ids(model, prompt[:20].tolist(), sampling)]
    assert tokens == [t for t, _, _ in generate_ids(hf_model, prompt[:20].tolist(), sampling)]
    return model


def llama_cpp_scores(llama_cpp, gguf_path: Path, ids: list[int], n_ctx: int) -> np.ndarray:
    """llama.cpp's logits at every position of one prefill of ``ids``."""
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=len(ids), n_ubatch=len(ids),
                          n_threads=2, logits_all=True, verbose=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)])
    finally:
        llm.close()


def llama_cpp_greedy(llama_cpp, gguf_path: Path, ids: list[int], n: int, n_ctx: int) -> list[int]:
    """llama.cpp's ``n`` greedy tokens after ``ids``."""
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=2, verbose=False)
    try:
        out: list[int] = []
        for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(int(t))
            if len(out) == n:
                return out
        return out
    finally:
        llm.close()


def assert_same_model(g, h) -> None:
    """The GGUF's files ``g`` hold the HF checkpoint ``h``'s model: the config's shapes, every
    tensor under the same canonical name, nothing left unmapped."""
    import pytest

    cg, ch = g.config, h.config
    assert cg.arch == ch.arch
    assert cg.rms_norm_eps == pytest.approx(ch.rms_norm_eps, rel=1e-6)  # stored as float32
    assert cg.linear_attn == ch.linear_attn and cg.moe == ch.moe and cg.rope == ch.rope
    assert (cg.attention_layers, cg.rotary_dim, cg.num_kv_heads, cg.vocab_size, cg.num_layers,
            cg.tie_word_embeddings) == (ch.attention_layers, ch.rotary_dim, ch.num_kv_heads, ch.vocab_size,
                                        ch.num_layers, ch.tie_word_embeddings)
    assert g.source.unmapped == []
    assert g.source.names() == h.source.names()
    for name in h.source.names():
        want, got = h.source.get(name), g.source.get(name)
        assert got.shape == want.shape, name
        # norms come back as (1 + w) - 1 in fp32: equal to rounding
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


def assert_generate_equal(gguf_path: Path, hf_dir: Path) -> None:
    """`moestream generate --model x.gguf`: the tokenizer built from the GGUF's tokenizer.ggml.*
    keys encodes as the checkpoint directory's, and the generated text is the directory's."""
    from click.testing import CliRunner

    from engine.loading import load_model
    from services.cli import main

    _, tok, _ = load_model(gguf_path)
    _, hf_tok, _ = load_model(hf_dir)
    text = "Hello there, tell me about recurrent state 123"
    assert tok.encode(text) == hf_tok.encode(text) and tok.eos_token_ids == hf_tok.eos_token_ids
    args = ["--dense", "fp32", "--max-tokens", "12", text]
    a = CliRunner().invoke(main, ["generate", "--model", str(gguf_path), *args])
    b = CliRunner().invoke(main, ["generate", "--model", str(hf_dir), *args])
    assert a.exit_code == 0 and b.exit_code == 0, (a.output, b.output)
    assert a.stdout == b.stdout and len(a.stdout.strip()) > 0


def rewrite_gguf(src: Path, dst: Path, drop: str | None = None, replace: dict | None = None) -> Path:
    """``src`` rewritten with gguf-py, every key kept, tensor ``drop`` (if any) left out and the
    tensors named in ``replace`` (GGUF name -> numpy array in gguf-py's order) swapped in."""
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch=r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in r.tensors:
        if t.name != drop:
            w.add_tensor(t.name, (replace or {}).get(t.name, np.asarray(t.data)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
