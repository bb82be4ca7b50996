"""bench/beyond_ram.py's parts on a tiny shape: the synthesised store runs in moestream, the
GGUF holds Q4_K blocks of the same shapes that llama.cpp's reader parses, and a child in a
limited cgroup has its peak and OOM kill counted (skipped where cgroups cannot be written)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
TINY = dict(name="tiny", layers=2, hidden=256, experts=8, top_k=2, width=256, heads=4, kv_heads=2, head_dim=64,
            vocab=512)


@pytest.fixture(scope="module")
def M():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("beyond_ram_model")
    finally:
        sys.path.remove(str(BENCH))


def test_store_runs_and_gguf_has_the_same_shapes_in_q4_k(M, tmp_path):
    import gguf

    from engine.experts.runtime import load_from_store

    shape = M.Shape(**TINY)
    M.write_store(shape, tmp_path / "store")
    M.write_gguf(shape, tmp_path / "m.gguf")
    with load_from_store(tmp_path / "store", dense="int8", prefetch_depth=0) as sm:
        cfg = sm.model.config
        assert (cfg.arch, cfg.num_layers, cfg.moe.num_experts, cfg.moe.top_k) == ("qwen3_moe", 2, 8, 2)
        assert sm.store.num_experts_total == 16
        a = sm.store.read_expert(0, 0, verify=True).tobytes()
        b = sm.store.read_expert(1, 3, verify=True).tobytes()
        assert a != b  # each expert its own random codes
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    ts = {t.name: t for t in r.tensors}
    exps = ts["blk.1.ffn_down_exps.weight"]
    assert exps.tensor_type == gguf.GGMLQuantizationType.Q4_K
    assert list(exps.shape) == [shape.width, shape.hidden, shape.experts]  # GGUF order: innermost first
    assert int(exps.n_bytes) == shape.experts * shape.hidden * shape.width * 9 // 16  # 4.5 bits/weight
    assert ts["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    d = np.asarray(ts["blk.0.attn_q.weight"].data).reshape(-1, 144)[:, :4].copy().view(np.float16)
    assert np.all(d == np.array([M.Q4K_D, M.Q4K_DMIN], dtype=np.float16))  # finite block scales, as written
    # zero-mean weights of the store's spread (a positive mean per block made the GGUF's hidden
    # states lean one way and route to far fewer experts than the store)
    from gguf.quants import dequantize

    w = dequantize(np.asarray(exps.data)[0], gguf.GGMLQuantizationType.Q4_K)
    assert abs(float(w.mean())) < 0.002 and 0.02 < float(w.std()) < 0.035
    from engine.quant.reference import dequantize as dequantize_ours

    with load_from_store(tmp_path / "store", dense="int8", prefetch_depth=0) as sm:
        g, _, _ = sm.store.expert_tensors(0, 0, sm.store.read_expert(0, 0))
        ours = dequantize_ours(g).float()
    assert abs(float(ours.mean())) < 0.002 and 0.02 < float(ours.std()) < 0.035


def test_a_child_over_its_limit_is_counted_as_an_oom_kill():
    sys.path.insert(0, str(BENCH))
    try:
        from cgroup_limit import LimitedGroup, NoCgroup
    finally:
        sys.path.remove(str(BENCH))
    try:
        g = LimitedGroup(64 * 2**20)
    except NoCgroup as e:
        pytest.skip(str(e))
    with g:
        fine = subprocess.run([sys.executable, "-c", "b = bytearray(8 << 20)"], preexec_fn=g.enter)
        assert fine.returncode == 0 and 8 << 20 <= g.peak() <= 64 * 2**20 and g.oom_kills() == 0
        r = subprocess.run([sys.executable, "-c", "b = bytearray(512 << 20)"], preexec_fn=g.enter)
        assert r.returncode == -9 and g.oom_kills() == 1


def test_moestream_child_decodes_the_fixed_continuation_and_counts_its_reads(M, tmp_path):
    """The moestream child (no limit here: every budget fits) feeds the prompt and then the fixed
    continuation one token per step, the one the llama.cpp child feeds; the simulator replays the
    run's own routing (misses after a cold start: at least every expert routed to once)."""
    sys.path.insert(0, str(BENCH))
    try:
        B = importlib.import_module("beyond_ram")
    finally:
        sys.path.remove(str(BENCH))
    shape = M.Shape(**TINY)
    M.write_store(shape, tmp_path / "store")
    cont = B.continuation(shape.vocab, 6)
    assert cont == B.continuation(shape.vocab, 6) and len(cont) == 5 and len(set(cont)) > 1
    out = B.moestream_child(str(tmp_path / "store"), 4, 6, 1, 2, warm=False)
    assert out["decode"] > 0 and out["prefill"] > 0
    assert out["nvme_bytes"] > 0 and out["sim_decode_bytes"] >= 0
    assert out["warmed"] == 0
    # the decode's cache counters: a cold cache misses in the decode steps too, and the split of a
    # token names them
    w = out["wait"]
    assert w["misses"] > 0 and w["misses"] + w["hits"] == 5 * shape.layers * shape.top_k
    assert w["stall_s"] >= 0 and w["late_prefetch"] == 0
    split = B.token_split(out, 6)
    assert split.startswith(f"{1e3 / out['decode']:.0f} ms = ") and f"{w['misses'] / 5:.1f} misses" in split
    # the process's peak RSS after load, prefill and decode: never falls, and the run's peak is the last
    assert len(out["peaks"]) == 3 and out["peaks"] == sorted(out["peaks"]) and out["peaks"][0] > 0
    assert abs(out["maxrss"] - out["peaks"][-1]) <= 4 << 20
    # the footprint bound's base: the dense weights the tiers were planned beside + the KV budget
    from engine.experts.runtime import dense_resident_bytes
    from engine.store.reader import ExpertStore

    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * (4 + 6 + 16) * 4
    with ExpertStore(tmp_path / "store") as st:
        assert out["resident"] == dense_resident_bytes(st, dense="int8") + kv > kv


def test_disk_use_is_taken_against_the_probes_around_each_run(tmp_path):
    """sequential_bandwidth reads the files it is given with O_DIRECT; summarise's disk use is
    each run's decode bytes/s over the bandwidth probed around that run (the median over runs)."""
    sys.path.insert(0, str(BENCH))
    try:
        M = importlib.import_module("beyond_ram")
    finally:
        sys.path.remove(str(BENCH))
    f = tmp_path / "blob"
    f.write_bytes(bytes(range(256)) * (4 << 12))  # 4 MiB
    try:
        assert M.sequential_bandwidth([f], 0.2) > 0
    except OSError as e:  # a filesystem without O_DIRECT (tmpfs)
        pytest.skip(f"no O_DIRECT here: {e}")
    new = 5
    runs = [{"decode": 2.0, "prefill": 1.0, "io": [(0, 0), (0, 0), (0, 0), (4 * 100, 0)], "disk_bw": 400.0},
            {"decode": 4.0, "prefill": 1.0, "io": [(0, 0), (0, 0), (0, 0), (4 * 100, 0)], "disk_bw": 200.0},
            {"decode": 1.0, "prefill": 1.0, "io": [(0, 0), (0, 0), (0, 0), (4 * 100, 0)], "disk_bw": 100.0}]
    s = M.summarise(runs, new)  # 100 bytes per decoded token: uses 0.5, 2.0, 1.0
    assert s["use"] == pytest.approx(1.0) and s["disk_bw"] == 200.0


def test_the_summary_line_names_a_refusals_minimum_and_the_ratio():
    """The last line: moestream's decode against the faster llama.cpp row that ran, or, where
    moestream refused the limit, the minimum its typed error named (not the cgroup's path)."""
    sys.path.insert(0, str(BENCH))
    try:
        M = importlib.import_module("beyond_ram")
    finally:
        sys.path.remove(str(BENCH))
    llama = {"llama.cpp": {"refused": [], "dead": ["killed by SIGKILL"]},
             "llama.cpp mmap": {"refused": [], "dead": [], "decode": 4.0}}
    ran = {"moestream": {"refused": [], "dead": [], "decode": 10.0, "use": 0.71}, **llama}
    assert M.summary_line("50%", ran) == ("beyond-ram 50%: moestream 10.00 tok/s, llama.cpp 4.00 tok/s (2.5x), "
                                          "disk use 71% of bandwidth")
    split = M.token_split({"decode": 10.0, "wait": {"stall_s": 0.6, "misses": 30, "hits": 90, "overlapped": 60,
                                                    "late_prefetch": 6}}, 7)
    assert split == ("100 ms = 100 ms waiting for reads + 0 ms computing; 5.0 misses (1.0 of them prefetches "
                     "still landing), 10.0 hits computed while reads ran")
    refused = {"moestream": {"refused": ["cgroup limit 381.47 MiB (/sys/fs/cgroup/memory/x/memory.limit_in_bytes) "
                                         "cannot hold this model: it needs at least 459.36 MiB (481675264 B): ..."],
                             "dead": []}, **llama}
    assert M.summary_line("400 MB", refused) == ("beyond-ram 400 MB: moestream refused (needs at least 459.36 MiB), "
                                                 "llama.cpp 4.00 tok/s (n/a), disk use n/a% of bandwidth")
