"""The loaders' shared-memory RAM tier and the decode side's LoaderPoolSource, without Ray:
bytes equal the store's, checksums checked on entry to RAM, the seqlock rejects a reused slot,
ownership moves minimally, and failed fetches are retried on the (new) owner."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future

import pytest
import torch

from engine.errors import ExpertLoadError
from engine.store import ExpertStore
from services.expert_loader import (
    SHM_DIR,
    ExpertLoader,
    LoaderPoolSource,
    MappedSegment,
    rendezvous_owner,
    segment_prefix,
)


class LoopThread:
    """An asyncio loop on a thread, standing in for an async actor."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.t = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.t.start()

    def run(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.t.join()


class FakeHandle:
    """``handle.fetch.remote(frames)`` -> a Future; failures are scripted."""

    def __init__(self, loader, lt, fail=()):
        self.loader, self.lt, self.fail, self.calls = loader, lt, list(fail), 0
        self.on_fail = None
        outer = self

        class _M:
            def remote(self, frames):
                outer.calls += 1
                if outer.fail:
                    exc = outer.fail.pop(0)
                    if outer.on_fail:
                        outer.on_fail()
                    f = Future()
                    f.set_exception(exc)
                    return f
                return outer.lt.run(outer.loader.fetch(frames))

        self.fetch = _M()


def fake_get(fut, timeout):
    return fut.result(timeout)


@pytest.fixture()
def env(store_path, slot_info):
    slot, _, _ = slot_info
    lt = LoopThread()
    loaders = {n: lt.run(_make(n, store_path, 4 * slot)).result() for n in ("loader-0", "loader-1")}
    store = ExpertStore(store_path)
    yield lt, loaders, store
    for ld in loaders.values():
        lt.run(ld.close()).result()
    store.close()
    lt.stop()


async def _make(name, store_path, budget):
    return ExpertLoader(name, str(store_path), budget, namespace="unit-test")


def all_keys(store):
    return sorted(store._entries)


def test_bytes_equal_store_and_direct_reads_skip_the_loader(env):
    lt, loaders, store = env
    handles = {n: FakeHandle(ld, lt) for n, ld in loaders.items()}
    src = LoaderPoolSource(store, handles, get=fake_get)
    out = torch.empty(src.slot_bytes, dtype=torch.uint8)
    key = all_keys(store)[0]
    want = bytes(store.read_expert(*key))
    assert src.read_into(key, out) == "nvme"
    assert bytes(out[:len(want)].numpy()) == want
    calls = sum(h.calls for h in handles.values())
    out.zero_()
    assert src.read_into(key, out) == "ram"  # direct: validated copy from shared memory
    assert bytes(out[:len(want)].numpy()) == want
    assert sum(h.calls for h in handles.values()) == calls
    assert src.stats()["direct_hits"] == 1
    # every key, through a 4-slot tier per loader: evictions, re-reads, identical bytes
    for k in all_keys(store) * 2:
        src.read_into(k, out)
        assert bytes(out[:store.entry(*k).nbytes].numpy()) == bytes(store.read_expert(*k))


def test_seqlock_rejects_a_reused_slot(env):
    lt, loaders, store = env
    ld = loaders["loader-0"]
    k0, k1 = all_keys(store)[:2]
    slot, _ = lt.run(ld.tier.fetch(k0)).result()
    seg = MappedSegment(ld.tier.name)
    dst = torch.empty(seg.slot_bytes, dtype=torch.uint8).numpy()
    assert seg.copy_out(slot, k0, dst) == store.entry(*k0).nbytes
    assert seg.copy_out(slot, k1, dst) == 0  # wrong key
    ld.tier.hdr["seq"][slot] += 1  # a writer is mid-way
    assert seg.copy_out(slot, k0, dst) == 0
    ld.tier.hdr["seq"][slot] += 1


def test_checksum_checked_when_a_blob_enters_ram(store_path, slot_info, tmp_path):
    import shutil

    from protocol import ErrorCode, ErrorReply, ExpertFetch, decode, encode

    bad = tmp_path / "store"
    shutil.copytree(store_path, bad)
    with ExpertStore(bad) as s:
        e = s.entry(*all_keys(s)[3])
    with open(bad / e.file, "r+b") as f:  # flip one byte of that expert
        f.seek(e.offset + 7)
        b = f.read(1)
        f.seek(e.offset + 7)
        f.write(bytes([b[0] ^ 0xFF]))
    lt = LoopThread()
    ld = lt.run(_make("loader-0", bad, 4 * slot_info[0])).result()
    try:
        reply, _ = decode(lt.run(ld.fetch(encode(ExpertFetch(layer=e.layer, expert=e.expert, seq=1)))).result())
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.EXPERT_LOAD
        assert f"layer {e.layer} expert {e.expert}" in reply.message
        with ExpertStore(bad) as s:  # the source raises it, without retrying
            src = LoaderPoolSource(s, {"loader-0": FakeHandle(ld, lt)}, get=fake_get)
            with pytest.raises(ExpertLoadError, match="checksum"):
                src.read_into((e.layer, e.expert), torch.empty(src.slot_bytes, dtype=torch.uint8))
        # the failed read gave its slot back and the loader's segment is still there
        assert ld.tier.table.slot_of == {} and sorted(ld.tier.table.free_slots) == list(range(ld.tier.num_slots))
        assert ld.tier.name.startswith(segment_prefix("unit-test", "loader-0"))
        assert os.path.isfile(os.path.join(SHM_DIR, ld.tier.name))
    finally:
        lt.run(ld.close()).result()
        lt.stop()
    assert not os.path.exists(os.path.join(SHM_DIR, ld.tier.name))  # close unlinked it


def test_failed_fetches_are_retried_on_the_new_owner(env):
    from ray.exceptions import GetTimeoutError

    lt, loaders, store = env
    key = next(k for k in all_keys(store) if rendezvous_owner(k, ["loader-0", "loader-1"]) == "loader-0")
    dead = FakeHandle(loaders["loader-0"], lt, fail=[GetTimeoutError("slow"), RuntimeError("x")])
    live = FakeHandle(loaders["loader-1"], lt)
    src = LoaderPoolSource(store, {"loader-0": dead, "loader-1": live}, get=fake_get,
                           fetch_attempts=3)
    out = torch.empty(src.slot_bytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError):  # not a transport error: not retried
        dead.fail = [RuntimeError("bug")]
        src.read_into(key, out)
    dead.fail = [GetTimeoutError("slow")] * 5
    with pytest.raises(ExpertLoadError, match="3 attempts"):
        src.read_into(key, out)
    # the owner times out and is removed meanwhile (scale-down): the retry goes to the new owner
    dead.fail = [GetTimeoutError("slow")]
    dead.on_fail = lambda: src.set_loaders({"loader-1": live})
    assert src.read_into(key, out) in ("ram", "nvme")
    assert bytes(out[:store.entry(*key).nbytes].numpy()) == bytes(store.read_expert(*key))
    assert src.stats()["retries"] == 4 and live.calls == 1


def test_rendezvous_moves_only_the_keys_of_the_joining_loader():
    keys = [(l, e) for l in range(4) for e in range(64)]
    two = {k: rendezvous_owner(k, ["loader-0", "loader-1"]) for k in keys}
    three = {k: rendezvous_owner(k, ["loader-0", "loader-1", "loader-2"]) for k in keys}
    moved = [k for k in keys if two[k] != three[k]]
    assert moved and all(three[k] == "loader-2" for k in moved)
    assert 0.2 < len(moved) / len(keys) < 0.5
    with pytest.raises(ExpertLoadError, match="no expert loader"):
        rendezvous_owner((0, 0), [])
