"""Budgets from the process's own cgroup: the limit is read from the group /proc/self/cgroup
names (and its ancestors), not the root group; auto budgets fit under it with the stated margin;
a limit too small for the dense part is refused before loading, naming the minimum."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from engine.errors import HostMemoryError
from engine.experts import host_memory as hm
from engine.experts.device_budget import GiB, cgroup_memory_limit, host_memory, resolve_budgets
from engine.experts.host_memory import CGROUP_GROWTH, CGROUP_MARGIN, cgroup_working_set

MiB = 2**20
ROOT = Path(__file__).resolve().parents[3]


def _tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[str, str]:
    for rel, text in files.items():
        p = tmp_path / "cg" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (tmp_path / "cgroup").write_text(proc)
    return str(tmp_path / "cgroup"), str(tmp_path / "cg")


def test_v1_limit_of_the_process_group_not_the_root(tmp_path):
    proc, root = _tree(tmp_path, "4:memory:/jobs/a\n3:cpu:/\n0::/\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/jobs/memory.limit_in_bytes": str(8 * GiB),
        "memory/jobs/a/memory.limit_in_bytes": str(GiB),
    })
    assert cgroup_memory_limit(proc, root) == (GiB, f"{root}/memory/jobs/a/memory.limit_in_bytes")


def test_an_ancestor_limit_below_the_group_wins(tmp_path):
    proc, root = _tree(tmp_path, "4:memory,hugetlb:/jobs/a\n", {
        "memory/jobs/memory.limit_in_bytes": str(512 * MiB),
        "memory/jobs/a/memory.limit_in_bytes": "9223372036854771712",
    })
    assert cgroup_memory_limit(proc, root)[0] == 512 * MiB


def test_v2_memory_max_and_max_means_none(tmp_path):
    proc, root = _tree(tmp_path, "0::/user/job\n", {
        "memory.max": "max\n", "user/memory.max": "max\n", "user/job/memory.max": str(3 * GiB) + "\n",
    })
    assert cgroup_memory_limit(proc, root)[0] == 3 * GiB
    proc, root = _tree(tmp_path / "b", "0::/user/job\n", {"user/job/memory.max": "max\n"})
    assert cgroup_memory_limit(proc, root) == (None, "")


def test_a_group_not_mounted_here_falls_back_to_the_root_files(tmp_path):
    proc, root = _tree(tmp_path, "4:memory:/elsewhere/x\n", {"memory/memory.limit_in_bytes": str(2 * GiB)})
    assert cgroup_memory_limit(proc, root)[0] == 2 * GiB


def test_working_set_is_usage_less_inactive_file_v1_and_v2(tmp_path):
    _, root = _tree(tmp_path, "", {
        "memory/a/memory.limit_in_bytes": str(GiB), "memory/a/memory.usage_in_bytes": str(300 * MiB),
        "memory/a/memory.stat": f"cache 1\ninactive_file 5\ntotal_inactive_file {40 * MiB}\n",
        "b/memory.max": str(GiB), "b/memory.current": str(200 * MiB) + "\n",
        "b/memory.stat": f"anon 7\ninactive_file {20 * MiB}\nactive_file 3\n",
    })
    assert cgroup_working_set(f"{root}/memory/a/memory.limit_in_bytes") == 260 * MiB  # v1: total_ (hierarchical)
    assert cgroup_working_set(f"{root}/b/memory.max") == 180 * MiB
    assert cgroup_working_set(f"{root}/none/memory.max") is None


def test_the_margin_under_a_limit_is_what_the_group_holds_plus_the_growth(tmp_path, monkeypatch):
    _, root = _tree(tmp_path, "", {"g/memory.max": str(GiB), "g/memory.current": str(250 * MiB),
                                   "g/memory.stat": f"inactive_file {10 * MiB}\n"})
    monkeypatch.setattr(hm, "host_memory", lambda available=False: 20 * GiB)
    monkeypatch.setattr(hm, "cgroup_memory_limit", lambda: (GiB, f"{root}/g/memory.max"))
    limit, margin, what = hm.host_limit()
    assert (limit, margin) == (GiB, 240 * MiB + CGROUP_GROWTH)
    assert "the group holds 240.00 MiB now" in what
    (tmp_path / "cg/g/memory.current").unlink()  # usage unreadable: the fixed margin
    assert hm.host_limit()[1] == CGROUP_MARGIN
    # a limit above the available RAM is not the binding one: the host headroom
    monkeypatch.setattr(hm, "cgroup_memory_limit", lambda: (40 * GiB, f"{root}/g/memory.max"))
    assert hm.host_limit()[1] == hm.HOST_HEADROOM


def test_dense_part_too_big_for_the_memory_is_refused_naming_the_minimum():
    with pytest.raises(HostMemoryError, match=r"needs at least 1\.75 GiB"):
        resolve_budgets(4 * GiB, device="cpu", resident=GiB + GiB // 2, headroom=GiB // 4, host_available=GiB)
    # given budgets on plain RAM (no cgroup limit) are not second-guessed
    b = resolve_budgets(4 * GiB, device="cpu", resident=GiB + GiB // 2, headroom=GiB // 4, host_available=GiB,
                        device_budget=GiB // 8, ram_budget=GiB // 8)
    assert (b.device, b.ram) == (GiB // 8, GiB // 8)


def _child_cgroup() -> Path | None:
    """A fresh child of this process's v1 memory group (None where it cannot be made)."""
    try:
        line = next(l for l in Path("/proc/self/cgroup").read_text().splitlines()
                    if "memory" in l.split(":")[1].split(","))
    except (OSError, StopIteration, IndexError):
        return None
    base = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/")
    d = base / f"moestream-test-{uuid.uuid4().hex[:8]}"
    try:
        d.mkdir()
        (d / "memory.limit_in_bytes").write_text(str(GiB))
    except OSError:
        try:
            d.rmdir()
        except OSError:
            pass
        return None
    return d


_CHILD = """
from engine.experts.device_budget import cgroup_memory_limit, host_limit, host_memory, resolve_budgets
from engine.experts.host_memory import cgroup_working_set
b = resolve_budgets(64 * 2**30, device="cpu", resident=100 * 2**20, staging=64 * 2**20)
limit, where = cgroup_memory_limit()
print(limit, host_memory(), b.ram, b.device, host_limit()[1], cgroup_working_set(where))
print(b.line)
"""


def test_a_process_in_a_smaller_child_cgroup_sizes_its_ram_tier_from_that_limit():
    d = _child_cgroup()
    if d is None:
        pytest.skip("cannot create a child memory cgroup here (needs cgroup v1 memory group writable by this user)")
    try:
        assert host_memory() > 2 * GiB  # the machine's figure, which the child must not use
        procs = str(d / "cgroup.procs")

        def enter():  # runs in the child before exec: join the limited group
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        r = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, capture_output=True, text=True,
                           preexec_fn=enter, timeout=300)
        assert r.returncode == 0, r.stderr
        limit, host, ram, dev, margin, held = map(int, r.stdout.split()[:6])
        assert limit == GiB and host == GiB
        # the margin is what the group holds (this Python with torch imported: ~150 MiB charged
        # to it) plus the growth allowance, read again a moment later
        assert 64 * MiB < held < 512 * MiB
        assert abs(margin - CGROUP_GROWTH - held) < 8 * MiB
        # the tiers share the limit less the margin and the resident part: the device slots
        # first, the RAM tier the staging bytes (the machine's 20+ GiB would give both 64 GiB)
        assert ram == 64 * MiB
        assert abs(dev - (GiB - margin - 100 * MiB - 64 * MiB)) < 8 * MiB
        assert "cgroup limit 1.00 GiB" in r.stdout and "the group holds" in r.stdout
    finally:
        d.rmdir()


@pytest.fixture(scope="module")
def small_store(tmp_path_factory) -> Path:
    from engine.quant.formats import QuantFormat
    from engine.store import convert
    from tests.engine.models.hf_tiny import make_checkpoint

    d = tmp_path_factory.mktemp("growth_store")
    make_checkpoint("qwen3_moe", d / "hf", seed=5, hidden_size=64, num_hidden_layers=2, head_dim=16,
                    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


def test_the_margin_counts_the_step_and_a_tokenizer_only_where_one_is_loaded(small_store, tmp_path, monkeypatch):
    """Under a cgroup limit store_budgets' margin is what the group holds plus what this run adds:
    one step of ``step_tokens`` (the scheduler's 512 unless told) and a tokenizer only when one
    loads after the budgets (issue 27: a token-id caller's 64-token prompt needs 42 MiB of it,
    not the 128 MiB once assumed for every run, which refused the 1.3B model at 300 MB)."""
    from engine.experts.runtime import _slot_bytes, dense_resident_bytes, store_budgets
    from engine.store.reader import ExpertStore
    from engine.units import format_bytes

    with ExpertStore(small_store) as st:
        hidden, k = st.config.hidden_size, st.config.moe.top_k
        resident = dense_resident_bytes(st, dense="int8") + MiB
        least = (k + 1) * _slot_bytes(st)
    held = 240 * MiB
    user = held + hm.GROWTH_BASE + hm.GROWTH_PER_TOKEN * hidden * 512 + hm.TOKENIZER_GROWTH
    ids = held + hm.GROWTH_BASE + hm.GROWTH_PER_TOKEN * hidden * 64
    limit = resident + least + (user + ids) // 2  # between the two runs' minimums
    _, root = _tree(tmp_path, "", {"g/memory.max": str(limit), "g/memory.current": str(held + 10 * MiB),
                                   "g/memory.stat": f"inactive_file {10 * MiB}\n"})
    monkeypatch.setattr(hm, "host_memory", lambda available=False: 20 * GiB)
    monkeypatch.setattr(hm, "cgroup_memory_limit", lambda: (limit, f"{root}/g/memory.max"))
    with pytest.raises(HostMemoryError) as e:
        store_budgets(small_store, dense="int8", kv_bytes=MiB)  # generate / serve: tokenizer after the budgets
    assert f"({resident + user + least} B)" in str(e.value)
    assert str(e.value).endswith("raise the limit")  # int8 dense already: no --dense int8 advice
    with pytest.raises(HostMemoryError, match=r"or use smaller dense formats \(--dense int8\)$"):
        store_budgets(small_store, dense="bf16", kv_bytes=MiB)
    b = store_budgets(small_store, dense="int8", kv_bytes=MiB, step_tokens=64, tokenizer=False)
    assert f"headroom {format_bytes(ids)} " in b.device_from  # the group's 240 MiB + this run's growth


_GROWTH_CHILD = """
import sys, torch
from engine.executor import executor_for, kv_dtype
from engine.experts.host_memory import process_footprint as anon
from engine.experts.runtime import dense_resident_bytes, load_from_store
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.store.reader import ExpertStore
torch.set_num_threads(1)
st = ExpertStore(sys.argv[1]); cfg = st.config
a0 = anon()
sm = load_from_store(st, dense="int8", warm=True, tokenizer=False)
held = dense_resident_bytes(st, dense="int8") + sm.cache.num_slots * sm.cache.slot_bytes
kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype(sm.model), initial_capacity=80)
g = torch.Generator().manual_seed(7)
with torch.inference_mode():
    executor_for(sm.model)(torch.randint(0, cfg.vocab_size, (64,), generator=g), BatchLayout.single(0, 64, 0), kv)
    for i in range(8):
        executor_for(sm.model)(torch.tensor([i]), BatchLayout.single(0, 1, 64 + i), kv)
print(anon() - a0 - held, cfg.hidden_size)
"""


def test_the_growth_allowance_covers_what_a_run_adds(small_store):
    """What a token-id run adds to the process's anonymous memory beyond its dense weights and
    expert slots (the load, the kernels' first use, a 64-token prompt and 8 decoded tokens, the
    KV cache) stays under the allowance its budgets keep for it: a run under a tight limit is
    not OOM-killed by what the budgets did not count."""
    from engine.experts.host_memory import growth_allowance

    r = subprocess.run([sys.executable, "-c", _GROWTH_CHILD, str(small_store)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    grew, hidden = map(int, r.stdout.split()[-2:])
    assert 0 < grew < growth_allowance(hidden, 64, tokenizer=False)


def test_process_footprint_is_this_process_anonymous_memory(tmp_path):
    """RssAnon of /proc/self/status: what a deployment counts for each actor it starts."""
    from engine.experts.host_memory import process_footprint

    f = tmp_path / "status"
    f.write_text("Name:\tpython\nVmRSS:\t  300000 kB\nRssAnon:\t  150000 kB\nRssFile:\t  150000 kB\n")
    assert process_footprint(str(f)) == 150000 * 1024
    assert process_footprint(str(tmp_path / "none")) == 0
    import torch  # noqa: F401  (imported here already: the footprint is at least torch's)

    assert process_footprint() > 64 * MiB
