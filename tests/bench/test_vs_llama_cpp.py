"""bench/vs_llama_cpp.py's building blocks on a tiny Qwen3-MoE: the GGUF it writes for llama.cpp
is the same model in moestream's own loader, its bytes-per-token agrees with the config's, and
the op counter sees the fused step's native calls. llama.cpp itself only where it is installed
and runs on this CPU."""

from __future__ import annotations

import pytest
import torch

from tests.bench.side_by_side import BENCH, bench_module


@pytest.fixture(scope="module")
def B():
    with bench_module("vs_llama_cpp") as m:
        yield m


@pytest.fixture(scope="module")
def tiny(B, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vs_llama_cpp")
    hf, cfg = B.build_hf(B.TINY_SHAPE)
    hf.save_pretrained(tmp / "hf")
    B.write_gguf(tmp / "f32.gguf", hf, cfg)
    return tmp, cfg, B.make_prompt(24, cfg.vocab_size)


def test_gguf_is_the_checkpoint_in_moestreams_loader(B, tiny):
    from engine.loading import load_model

    tmp, cfg, prompt = tiny
    from_gguf, tok, gcfg = load_model(tmp / "f32.gguf")
    assert tok is not None
    for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "moe",
              "qk_norm", "tie_word_embeddings"):
        assert getattr(gcfg, f) == getattr(cfg, f), f
    assert gcfg.rope.theta == cfg.rope.theta
    from_hf = B.load_fp32(tmp / "hf")
    sd_hf, sd_gguf = from_hf.state_dict(), from_gguf.state_dict()
    assert sd_hf.keys() == sd_gguf.keys()
    for k in sd_hf:
        assert torch.equal(sd_hf[k], sd_gguf[k]), k
    a, _, _ = B.moestream_greedy(from_hf, prompt, 8)
    b, _, _ = B.moestream_greedy(from_gguf, prompt, 8)
    assert a == b


def test_gguf_active_bytes_match_the_config(B, tiny):
    tmp, cfg, _ = tiny
    assert B.gguf_active_bytes(tmp / "f32.gguf", cfg) == B.active_weight_bytes(cfg, 4)
    assert B.gguf_bits_per_weight(tmp / "f32.gguf") == 32


def test_op_counts_see_the_native_step(B, tiny):
    from engine.experts.runtime import load_from_store
    from engine.quant.formats import QuantFormat
    from engine.quant.kernels import load_extension
    from engine.store import convert

    tmp, cfg, prompt = tiny
    if load_extension() is None:
        pytest.skip("native kernels unavailable: the step runs the torch layers")
    convert(tmp / "hf", tmp / "store", fmt=QuantFormat("int4", 64), progress=False)
    sm = load_from_store(tmp / "store", prefetch_depth=0, dense="int8", warm=True)  # every expert resident
    try:
        c = B.op_counts(sm.model, prompt, 2)
        b = B.phase_breakdown(sm.model, prompt, 6)
    finally:
        sm.close()
    # the breakdown: every phase of a decoded token of this model timed, and no more than the wall
    assert set(b["phases"]) == {"norm_qkv", "rope_kv", "attend", "o_proj", "route", "gather", "gate_up", "down",
                                "combine", "head"}
    assert all(b["phases"][k] > 0 for k in ("norm_qkv", "attend", "o_proj", "route", "gate_up", "down", "head"))
    assert sum(b["phases"].values()) < b["wall"] and b["rest"] == pytest.approx(b["wall"] - sum(b["phases"].values()))
    assert load_extension().phase_times()["head"] == 0.0  # timing off again, sums reset
    assert c["native_by_name"] == {"run_layers": 1}  # a decoded token: all layers and the head, one call
    assert c["native"] == 1
    assert c["ops"] > 0 and c["ops_per_layer"] == c["ops"] / cfg.num_layers
    assert type(load_extension().run_layers).__name__ == "builtin_function_or_method"  # unwrapped again


def _child_or_skip(B, path):
    from llama_child import LlamaCppChild, LlamaCppDied

    try:
        return LlamaCppChild(path, torch.get_num_threads(), 64, 32)
    except LlamaCppDied as e:  # e.g. the prebuilt wheel's SIGILL on Q8_0 on AVX-512 VNNI CPUs
        pytest.skip(str(e))


def test_llama_cpp_q8_0_agrees_with_moestream_fp32(B, tiny):
    pytest.importorskip("llama_cpp")
    tmp, cfg, prompt = tiny
    from llama_child import LlamaCppDied

    try:  # in a child: a wheel built for instructions this CPU lacks dies quantizing (AVX2-only EPYC)
        q8 = B.llama_quantize(tmp / "f32.gguf", tmp / "q8.gguf", "Q8_0", torch.get_num_threads())
    except LlamaCppDied as e:
        pytest.skip(str(e))
    lc = _child_or_skip(B, q8)
    try:
        got, _, _ = lc.greedy(prompt, 8)
    except Exception as e:  # the SIGILL may come at the first eval, not at load
        pytest.skip(str(e))
    finally:
        lc.close()
    ref, _, _ = B.moestream_greedy(B.load_fp32(tmp / "hf"), prompt, 8)
    assert got[:4] == ref[:4]


def test_a_llama_cpp_child_that_dies_says_how_and_leaves_the_parent_running(B, tiny):
    """What the bench does with a format whose child is killed (SIGILL here, sent by hand):
    LlamaCppDied naming the signal, from the call that was waiting on it."""
    import os
    import signal

    from llama_child import LlamaCppChild, LlamaCppDied

    pytest.importorskip("llama_cpp")
    tmp, cfg, prompt = tiny
    lc = _child_or_skip(B, tmp / "f32.gguf")  # a wheel that cannot run here at all (SIGILL at load)
    try:
        with pytest.raises(LlamaCppDied, match="exit status 1"):  # not a GGUF: the load fails
            (tmp / "junk.gguf").write_bytes(b"not a gguf")
            LlamaCppChild(tmp / "junk.gguf", 1, 64, 32)
        try:
            toks, pf, dec = lc.greedy(prompt, 3)
        except LlamaCppDied as e:  # or at its first eval
            pytest.skip(str(e))
        assert len(toks) == 3 and pf > 0 and dec > 0
        os.kill(lc.pid, signal.SIGILL)
        with pytest.raises(LlamaCppDied, match="killed by SIGILL"):
            lc.greedy(prompt, 3)
    finally:
        lc.close()


def test_a_child_loads_the_llama_cpp_build_it_is_given(B, tiny, tmp_path):
    """``lib=DIR``: the child's binding loads llama.cpp's libraries from DIR (LLAMA_CPP_LIB_PATH):
    a directory without them is a death that says so; a native build (bash
    bench/build_llama_cpp.sh .llama-native), where one was made, decodes the wheel's tokens."""
    from llama_child import LlamaCppChild, LlamaCppDied

    pytest.importorskip("llama_cpp")
    tmp, cfg, prompt = tiny
    with pytest.raises(LlamaCppDied, match="Shared library with base name 'llama' not found"):
        LlamaCppChild(tmp / "f32.gguf", 1, 64, 32, lib=tmp_path)
    native = BENCH.parent / ".llama-native"
    if not (native / "libllama.so").exists():
        pytest.skip("no native llama.cpp build in .llama-native (bash bench/build_llama_cpp.sh)")
    got = {}
    for lib in (None, native):
        lc = LlamaCppChild(tmp / "f32.gguf", 1, 64, 32, lib=lib)
        try:
            got[lib] = lc.greedy(prompt, 6)[0]
        finally:
            lc.close()
    assert got[None] == got[native]


def test_round_ratios_pair_each_round_with_its_own_best_peer(B):
    """A round's ratio is ours over the faster peer of that round, not of the medians: a peer that is
    fastest in one round and slow in the next is matched round by round; rounds a row lacks (its
    child died) are left out."""
    assert B.round_ratios([10.0, 20.0, 30.0], [[5.0, 10.0, 7.5], [8.0, 40.0]]) == [10 / 8, 20 / 40]
    assert B.round_ratios([12.0], [[6.0], [4.0]]) == [2.0]


def test_the_bench_runs_end_to_end_on_a_tiny_model(B, capsys):
    """``main`` as a user runs it, on the tiny shape: every moestream row is timed and tabled with
    its op counts and phases; with llama.cpp installed, the Q8_0 agreement check runs on the first
    build whose Q8_0 loads (or says why none did) and every format either has a row or a line
    saying how its child died."""
    B.main(["--shape", "tiny", "--prompt", "16", "--new", "4", "--rounds", "1", "--check-tokens", "4",
            "--profile-steps", "2", "--threads", "1"])
    out = capsys.readouterr().out
    assert "(tiny shape), 2 layers" in out
    table = [line for line in out.splitlines() if line.startswith("| moestream |")]
    assert len(table) == len(B.MOESTREAM_ROWS)
    assert any("(the default)" in line for line in table)
    assert out.count("native calls per token: 1 ") == len(B.MOESTREAM_ROWS)  # all layers and the head
    assert out.count("Python and call overhead") == len(B.MOESTREAM_ROWS)
    if not B.have_llama_cpp():
        assert "llama.cpp column skipped" in out
        return
    assert "Q8_0 vs moestream fp32" in out or "llama.cpp Q8_0 check skipped" in out
    for fmt in ("Q4_0", "Q4_K_M"):
        assert f"| llama.cpp | {fmt} (" in out or f"llama.cpp {fmt}: no row" in out, fmt


@pytest.mark.parametrize("cpu,amx,want", [
    ("fpu avx avx2 fma f16c bmi2 avx512f avx512_vnni amx_tile amx_int8", [],
     ["-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=OFF",
      "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]),
    ("fpu avx avx2 fma f16c bmi2 avx512f avx512_vnni amx_tile amx_int8", ["--amx"], ["-DGGML_NATIVE=ON"]),
    ("fpu avx avx2 fma f16c bmi2 avx512f avx512_vnni", [], ["-DGGML_NATIVE=ON"]),
])
def test_the_native_build_leaves_amx_out_unless_asked(tmp_path, cpu, amx, want):
    """bench/build_llama_cpp.sh on a CPU with AMX builds the other instruction sets the CPU lists
    and not AMX (its GGML_NATIVE build with AMX died of SIGSEGV at the first decode on an Intel
    Xeon VM); elsewhere, or with --amx, GGML_NATIVE."""
    import subprocess

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {cpu}\n")
    script = BENCH / "build_llama_cpp.sh"
    out = subprocess.run(["bash", str(script), *amx, "--print-flags"], env={"PATH": "/usr/bin:/bin", "CPUINFO": str(info)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == want if want == ["-DGGML_NATIVE=ON"] else set(want) <= set(out)
