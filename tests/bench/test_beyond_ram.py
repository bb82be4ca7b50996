"""bench/beyond_ram.py's parts on a tiny shape: the GGUF holds Q4_K blocks that llama.cpp's
reader parses and the store converted from it the same weights, which run in moestream; a child
in a limited cgroup has its peak and OOM kill counted (skipped where cgroups cannot be written)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.bench.side_by_side import BENCH, bench_module

TINY = dict(name="tiny", layers=2, hidden=256, experts=8, top_k=2, width=256, heads=4, kv_heads=2, head_dim=64,
            vocab=512)


@pytest.fixture(scope="module")
def B():
    with bench_module("beyond_ram") as m:
        yield m


@pytest.fixture(scope="module")
def M():
    with bench_module("beyond_ram_model") as m:
        yield m


def test_the_store_converted_from_the_gguf_holds_the_same_weights(M, tmp_path):
    """Both systems run one model: the GGUF's Q4_K blocks come back bit for bit from the store's
    int4 g64 experts and bf16 dense file (a store written from other random numbers routed unlike
    the GGUF, and llama.cpp ran an easier workload for it)."""
    import gguf
    import torch
    from gguf.quants import dequantize
    from safetensors import safe_open

    from engine.experts.runtime import load_from_store
    from engine.quant.reference import dequantize as dequantize_ours

    shape = M.Shape(**TINY)
    M.write_gguf(shape, tmp_path / "m.gguf")
    M.write_store(tmp_path / "m.gguf", tmp_path / "store")
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    ts = {t.name: t for t in r.tensors}
    exps = ts["blk.1.ffn_down_exps.weight"]
    assert exps.tensor_type == gguf.GGMLQuantizationType.Q4_K
    assert list(exps.shape) == [shape.width, shape.hidden, shape.experts]  # GGUF order: innermost first
    assert int(exps.n_bytes) == shape.experts * shape.hidden * shape.width * 9 // 16  # 4.5 bits/weight
    assert ts["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    d = np.asarray(ts["blk.0.attn_q.weight"].data).reshape(-1, 144)[:, :4].copy().view(np.float16)
    assert np.all(d == np.array([M.Q4K_D, M.Q4K_DMIN], dtype=np.float16))  # finite block scales, as written
    with load_from_store(tmp_path / "store", dense="int8", prefetch_depth=0) as sm:
        cfg = sm.model.config
        assert (cfg.arch, cfg.num_layers, cfg.moe.num_experts, cfg.moe.top_k) == ("qwen3_moe", 2, 8, 2)
        st = sm.store
        assert st.num_experts_total == 16
        assert st.fmt.name == "int4" and st.fmt.group_size == 64
        seen = []
        for layer, e in ((0, 0), (1, 3), (1, 7)):
            mine = st.expert_tensors(layer, e, st.read_expert(layer, e, verify=True))
            for name, ours in zip(("gate", "up", "down"), mine):
                want = dequantize(np.asarray(ts[f"blk.{layer}.ffn_{name}_exps.weight"].data)[e],
                                  gguf.GGMLQuantizationType.Q4_K)
                got = dequantize_ours(ours).float().numpy()
                np.testing.assert_array_equal(got, want)
            # zero-mean, the spread of a random dense layer (a positive mean per block made the
            # hidden states lean one way)
            assert abs(float(want.mean())) < 0.002 and 0.015 < float(want.std()) < 0.025
            seen.append(got)
        assert not np.array_equal(seen[1], seen[2])  # each expert its own random codes
    with safe_open(str(tmp_path / "store" / "dense.safetensors"), "pt") as f:
        for ours, theirs in (("model.embed_tokens.weight", "token_embd.weight"),
                             ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
                             ("model.layers.1.mlp.gate.weight", "blk.1.ffn_gate_inp.weight")):
            got = f.get_tensor(ours)
            assert got.dtype == torch.bfloat16
            t = ts[theirs]
            want = dequantize(np.asarray(t.data), t.tensor_type).reshape(got.shape)
            np.testing.assert_array_equal(got.float().numpy(), want)
    want = dequantize(np.asarray(ts["token_embd.weight"].data), gguf.GGMLQuantizationType.Q4_K)
    assert M.EMBED_SCALE == 64 and 0.9 < float(want.std()) < 1.5  # EMBED_SCALE x the layers' spread
    M.write_gguf(shape, tmp_path / "e8.gguf", embed_scale=8)
    t = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "e8.gguf")).tensors}["token_embd.weight"]
    assert 0.1 < float(dequantize(np.asarray(t.data), gguf.GGMLQuantizationType.Q4_K).std()) < 0.2
    with pytest.raises(ValueError, match="power of two"):
        M.write_gguf(shape, tmp_path / "e3.gguf", embed_scale=3)


def test_prefill_records_replay_each_layer_once_as_the_cache_acquired_it(B):
    """The simulator sees a prefill as the expert cache did: per layer, each distinct expert once
    (a prompt routing expert 2 from every row still counts one access), ascending, in records of
    top_k, the last topped up with experts already read (hits), layers in order."""
    rows = [(0, [2, 1]), (1, [5, 4]), (0, [2, 3]), (0, [2, 1]), (1, [4, 5])]
    assert B.prefill_records(rows, 2, 2) == [(0, [1, 2]), (0, [3, 1]), (1, [4, 5])]
    assert B.prefill_records(rows, 3, 2)[-1] == (1, [4, 5])  # a layer no row reached: no record


def test_routing_stats_count_experts_per_layer_and_the_new_share(B):
    # layer 0: tokens 0, 1 route {1, 2} then {2, 3}: 3 experts, half of token 1's new;
    # layer 1: {4, 5} twice: 2 experts, none new
    routed = [(0, 0, [1, 2]), (0, 1, [4, 5]), (1, 0, [2, 3]), (1, 1, [5, 4])]
    assert B.routing_stats(routed, 2) == {"distinct": 2.5, "new": 0.25}
    assert B.routing_stats([], 2) == {"distinct": 0.0, "new": 0.0}


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


def test_moestream_child_decodes_the_fixed_continuation_and_counts_its_reads(M, tmp_path, B):
    """The moestream child (no limit here: every budget fits) feeds the prompt and then the fixed
    continuation one token per step, the one the llama.cpp child feeds; the simulator replays the
    run's own routing (misses after a cold start: at least every expert routed to once)."""
    shape = M.Shape(**TINY)
    M.write_gguf(shape, tmp_path / "m.gguf")
    M.write_store(tmp_path / "m.gguf", tmp_path / "store")
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
    # the run's routing: at most every expert of a layer, and top_k of them at least
    assert shape.top_k <= out["routing"]["distinct"] <= shape.experts and 0 <= out["routing"]["new"] <= 1
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


def test_disk_use_is_taken_against_the_probes_around_each_run(tmp_path, B):
    """sequential_bandwidth reads the files it is given with O_DIRECT; summarise's disk use is
    each run's decode bytes/s over the bandwidth probed around that run (the median over runs)."""
    f = tmp_path / "blob"
    f.write_bytes(bytes(range(256)) * (4 << 12))  # 4 MiB
    try:
        assert B.sequential_bandwidth([f], 0.2) > 0
    except OSError as e:  # a filesystem without O_DIRECT (tmpfs)
        pytest.skip(f"no O_DIRECT here: {e}")
    new = 5
    runs = [{"decode": 2.0, "prefill": 1.0, "io": [(0, 0), (0, 0), (0, 0), (4 * 100, 0)], "disk_bw": 400.0},
            {"decode": 4.0, "prefill": 1.0, "io": [(0, 0), (0, 0), (0, 0), (4 * 100, 0)], "disk_bw": 200.0},
            {"decode": 1.0, "prefill": 1.0, "io": [(0, 0), (0, 0), (0, 0), (4 * 100, 0)], "disk_bw": 100.0}]
    s = B.summarise(runs, new)  # 100 bytes per decoded token: uses 0.5, 2.0, 1.0
    assert s["use"] == pytest.approx(1.0) and s["disk_bw"] == 200.0


def test_the_summary_line_names_a_refusals_minimum_and_the_ratio(B):
    """The last line: moestream's decode against the faster llama.cpp row that ran, or, where
    moestream refused the limit, the minimum its typed error named (not the cgroup's path)."""
    llama = {"llama.cpp": {"refused": [], "dead": ["killed by SIGKILL"]},
             "llama.cpp mmap": {"refused": [], "dead": [], "decode": 4.0}}
    ran = {"moestream": {"refused": [], "dead": [], "decode": 10.0, "use": 0.71}, **llama}
    assert B.summary_line("50%", ran) == ("beyond-ram 50%: moestream 10.00 tok/s, llama.cpp 4.00 tok/s (2.5x), "
                                          "disk use 71% of bandwidth")
    split = B.token_split({"decode": 10.0, "wait": {"stall_s": 0.6, "misses": 30, "hits": 90, "overlapped": 60,
                                                    "late_prefetch": 6}}, 7)
    assert split == ("100 ms = 100 ms waiting for reads + 0 ms computing; 5.0 misses (1.0 of them prefetches "
                     "still landing), 10.0 hits computed while reads ran")
    refused = {"moestream": {"refused": ["cgroup limit 381.47 MiB (/sys/fs/cgroup/memory/x/memory.limit_in_bytes) "
                                         "cannot hold this model: it needs at least 459.36 MiB (481675264 B): ..."],
                             "dead": []}, **llama}
    assert B.summary_line("400 MB", refused) == ("beyond-ram 400 MB: moestream refused (needs at least 459.36 MiB), "
                                                 "llama.cpp 4.00 tok/s (n/a), disk use n/a")


def test_the_whole_bench_runs_on_the_tiny_shape(tmp_path):
    """bench/beyond_ram.py end to end on a 2-layer model (GGUF written, store converted, disk
    probed, one moestream run in a limited cgroup, the table and the summary line), so a broken
    bench fails here and not an hour into a run; skipped where cgroups cannot be written."""
    import os

    cmd = [sys.executable, str(BENCH / "beyond_ram.py"), "--shape", "tiny", "--limits-mb", "2000", "--rounds", "1",
           "--prompt", "4", "--new", "4", "--no-llama", "--timeout", "120", "--dir", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    if r.returncode != 0 and "beyond-ram: " in r.stderr and "cgroup" in r.stderr:
        pytest.skip(r.stderr.strip()[-200:])
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "converted from the GGUF: the same weights" in out and "token embedding 64x" in out
    assert "routing: " in out and "| 2000 MB (2000 MB) | moestream |" in out
    assert "page-cache readahead of the model's filesystem: " in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("beyond-ram 2000 MB: moestream ") and "tok/s" in last
    assert (tmp_path / "store" / "manifest.json").is_file() and (tmp_path / "model.gguf").is_file()


def test_readahead_is_read_from_the_filesystems_backing_device(tmp_path, B):
    f = tmp_path / "x"
    f.write_bytes(b"x")
    import os

    dev = f.stat().st_dev
    want = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    got = B.readahead_kb(f)
    if want.is_file():
        assert got == int(want.read_text())
    else:
        assert got is None
    assert B.readahead_kb(tmp_path / "missing") is None
