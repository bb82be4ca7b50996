"""Host-memory pinning (engine.experts.pinning): the RAM tier's block registered in bounded
chunks within the process's total, a failed pin unwound and reported once, staged copies that
still serve every byte, close() unregistering each chunk once. CPU only, through a fake
registrar (the CUDA registrar's error handling through a fake cudart)."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.costmodel import SHAPES
from engine.errors import ConfigError
from engine.experts import pinning
from engine.experts.pinning import (CudaRegistrar, PinLimits, StagedCopier, copy_through, pin_buffer,
                                    registered_bytes)
from engine.experts.synthetic_disk import SyntheticDiskStore
from engine.experts.synthetic_store import SyntheticExpertStore
from engine.experts.tiers import HostTier
from engine.store.reader import ExpertStore

MiB = 1 << 20
TINY = SHAPES["tiny"]
LOGGER = "engine.experts.pinning"


class FakeRegistrar:
    """Records every call; the ``fail_on``-th register call (1-based) fails."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.fail_on = fail_on
        self.calls: list[tuple] = []
        self.registered: dict[int, int] = {}

    def register(self, ptr: int, nbytes: int) -> bool:
        self.calls.append(("register", ptr, nbytes))
        if sum(c[0] == "register" for c in self.calls) == self.fail_on:
            return False
        assert ptr not in self.registered
        self.registered[ptr] = nbytes
        return True

    def unregister(self, ptr: int) -> None:
        self.calls.append(("unregister", ptr))
        assert ptr in self.registered, f"{ptr:#x} unregistered but not registered"
        del self.registered[ptr]


@pytest.fixture(autouse=True)
def warn_again():
    """Each test starts with the once-per-process warning not yet given."""
    pinning.reset_warning()
    yield
    pinning.reset_warning()


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_a_buffer_is_registered_in_chunks_of_at_most_chunk_bytes():
    buf = torch.empty(10 * MiB, dtype=torch.uint8)
    reg, before = FakeRegistrar(), registered_bytes()
    bank = pin_buffer(buf, PinLimits(chunk_bytes=4 * MiB), reg)
    p = buf.data_ptr()
    assert reg.calls == [("register", p, 4 * MiB), ("register", p + 4 * MiB, 4 * MiB),
                         ("register", p + 8 * MiB, 2 * MiB)]
    assert bank.chunks == [(0, 4 * MiB), (4 * MiB, 4 * MiB), (8 * MiB, 2 * MiB)]
    assert bank.pinned and bank.reason is None
    assert registered_bytes() == before + 10 * MiB
    bank.close()
    assert registered_bytes() == before and not reg.registered


def test_chunk_boundaries_fall_on_the_granule():
    """The RAM tier passes its slot size: a 1 MiB chunk limit with 384 KiB slots gives chunks of
    two slots (768 KiB), never a slot cut in two."""
    slot = 384 * 1024
    buf = torch.empty(5 * slot, dtype=torch.uint8)
    reg = FakeRegistrar()
    bank = pin_buffer(buf, PinLimits(chunk_bytes=MiB), reg, granule=slot)
    assert bank.chunks == [(0, 2 * slot), (2 * slot, 2 * slot), (4 * slot, slot)]
    bank.close()


@pytest.mark.parametrize("kw", [dict(chunk_bytes=4096 * 3 + 1), dict(chunk_bytes=2048), dict(chunk_bytes=0),
                                dict(chunk_bytes=-4096), dict(max_total_bytes=0)])
def test_limits_out_of_range_are_config_errors(kw):
    with pytest.raises(ConfigError, match="PinLimits"):
        PinLimits(**kw)


def test_the_defaults_stay_below_the_reported_limits():
    limits = PinLimits()
    assert limits.chunk_bytes == 1 << 30 and limits.chunk_bytes < 4 * 10**9
    assert limits.max_total_bytes == 480 << 30 and limits.max_total_bytes < 512 << 30


def test_a_failed_chunk_unregisters_the_others_and_warns_once(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    before = registered_bytes()
    banks = []
    for _ in range(2):
        buf = torch.empty(10 * MiB, dtype=torch.uint8)
        reg = FakeRegistrar(fail_on=2)
        bank = pin_buffer(buf, PinLimits(chunk_bytes=4 * MiB), reg)
        p = buf.data_ptr()
        assert reg.calls == [("register", p, 4 * MiB), ("register", p + 4 * MiB, 4 * MiB), ("unregister", p)]
        assert not bank.pinned and bank.chunks == [] and not reg.registered
        assert "offset 4194304" in bank.reason
        assert registered_bytes() == before
        banks.append(bank)
    (w,) = warnings_of(caplog)  # one warning for two failed banks
    assert "offset 4194304" in w.getMessage() and "4.00 MiB" in w.getMessage()
    assert "staged through a small pinned buffer" in w.getMessage()
    later = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.DEBUG]
    assert any("pinning host memory failed" in r.getMessage() for r in later)
    banks[0].close()  # a failed bank has nothing left to unregister
    assert reg.calls[-1] == ("unregister", p)


def test_a_raising_registrar_counts_as_a_failed_pin(caplog):
    class Raising(FakeRegistrar):
        def register(self, ptr, nbytes):
            raise RuntimeError("driver said no")

    bank = pin_buffer(torch.empty(MiB, dtype=torch.uint8), PinLimits(chunk_bytes=MiB), Raising())
    assert not bank.pinned and bank.reason.startswith("cudaHostRegister")
    assert len(warnings_of(caplog)) == 1


def test_the_process_total_limit_stops_registration_and_falls_back(caplog):
    before = registered_bytes()
    limits = PinLimits(chunk_bytes=4 * MiB, max_total_bytes=before + 6 * MiB)
    buf = torch.empty(10 * MiB, dtype=torch.uint8)
    reg = FakeRegistrar()
    bank = pin_buffer(buf, limits, reg)
    p = buf.data_ptr()
    # the second chunk would pass the limit: never asked for, the first given back
    assert reg.calls == [("register", p, 4 * MiB), ("unregister", p)]
    assert not bank.pinned and "max_total_bytes" in bank.reason
    assert registered_bytes() == before
    (w,) = warnings_of(caplog)
    assert "max_total_bytes" in w.getMessage()
    # the total is the process's: a second bank counts against what the first holds ...
    first = pin_buffer(torch.empty(4 * MiB, dtype=torch.uint8), limits, FakeRegistrar())
    second = pin_buffer(torch.empty(4 * MiB, dtype=torch.uint8), limits, FakeRegistrar())
    assert first.pinned and not second.pinned
    # ... and closing the first gives its bytes back
    first.close()
    third = pin_buffer(torch.empty(4 * MiB, dtype=torch.uint8), limits, FakeRegistrar())
    assert third.pinned
    third.close()
    assert registered_bytes() == before


def test_close_unregisters_every_chunk_once():
    buf = torch.empty(10 * MiB, dtype=torch.uint8)
    reg, before = FakeRegistrar(), registered_bytes()
    bank = pin_buffer(buf, PinLimits(chunk_bytes=4 * MiB), reg)
    bank.close()
    bank.close()
    p = buf.data_ptr()
    assert [c for c in reg.calls if c[0] == "unregister"] == [
        ("unregister", p), ("unregister", p + 4 * MiB), ("unregister", p + 8 * MiB)]
    assert not bank.pinned and bank.chunks == [] and registered_bytes() == before


def test_staged_copies_go_through_the_stage_piece_by_piece():
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=g)
    dst = torch.zeros(12_288, dtype=torch.uint8)
    copy_through(torch.empty(4096, dtype=torch.uint8), src, dst)  # pieces of 4096, 4096, 1808
    assert torch.equal(dst[:10_000], src) and not dst[10_000:].any()
    out = torch.zeros(12_288, dtype=torch.uint8)
    StagedCopier(4096).copy(src, out)  # a CPU destination: a plain copy
    assert torch.equal(out[:10_000], src) and not out[10_000:].any()


class FakeCudart:
    def __init__(self, register_code=0, unregister_code=0, raises=False) -> None:
        self.register_code, self.unregister_code, self.raises = register_code, unregister_code, raises
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        if self.raises:
            raise RuntimeError("no CUDA")
        return self.register_code

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return self.unregister_code


@pytest.fixture
def cleared(monkeypatch):
    """Counts the CUDA registrar's calls to clear the runtime's last error."""
    count = []
    monkeypatch.setattr(pinning, "_get_last_error", lambda: count.append(1))
    return count


@pytest.mark.parametrize("fake,ok,error", [(FakeCudart(), True, None),
                                           (FakeCudart(register_code=2), False, "cudaError 2"),
                                           (FakeCudart(raises=True), False, "RuntimeError: no CUDA")])
def test_the_cuda_registrar_reports_failure_as_false_and_clears_the_error(monkeypatch, cleared, fake, ok,
                                                                          error):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    reg = CudaRegistrar()
    assert reg.register(0x1000, 8192) is ok
    assert fake.calls == [("register", 0x1000, 8192, 3)]  # portable | mapped
    assert reg.last_error == error and len(cleared) == (0 if ok else 1)


def test_the_cuda_registrar_unregister_never_raises(monkeypatch, cleared):
    fake = FakeCudart(unregister_code=1)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    CudaRegistrar().unregister(0x2000)
    assert fake.calls == [("unregister", 0x2000)] and len(cleared) == 1

    def gone():
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(torch.cuda, "cudart", gone)
    CudaRegistrar().unregister(0x2000)
    assert len(cleared) == 2


@pytest.fixture(scope="module")
def disk_store(tmp_path_factory):
    source = SyntheticExpertStore(TINY, seed=5).ram_source(pin_memory=False)
    with SyntheticDiskStore(source, tmp_path_factory.mktemp("pin") / "s") as path:
        yield source, path


def every_key():
    return [(layer, e) for layer in range(TINY.layers) for e in range(TINY.experts)]


def test_a_ram_tier_whose_pin_fails_still_serves_every_byte(disk_store, monkeypatch, caplog):
    source, path = disk_store
    with ExpertStore(path) as es:
        reg = FakeRegistrar(fail_on=2)
        tier = HostTier(es, 4 * source.slot_bytes, pin_memory=True, registrar=reg,
                        pin_limits=PinLimits(chunk_bytes=source.slot_bytes))
        assert tier.pinning is not None and not tier.pinning.pinned and not reg.registered
        assert len(warnings_of(caplog)) == 1
        staged = []
        copy = tier.copier.copy
        monkeypatch.setattr(tier.copier, "copy", lambda src, dst: (staged.append(1), copy(src, dst)))
        out = torch.empty(source.slot_bytes, dtype=torch.uint8)
        for key in every_key() + every_key()[:3]:  # misses (NVMe) and hits (RAM)
            out.zero_()
            tier.read_into(key, out)
            assert torch.equal(out[:es.expert_nbytes], source.blob(key)), key
        assert len(staged) == len(every_key()) + 3
        tier.close()
        tier.close()
        assert reg.calls[-1] == ("unregister", tier.buf.data_ptr())  # only the unwinding


def test_a_pinned_ram_tier_registers_whole_slots_copies_straight_and_closes_once(disk_store, monkeypatch):
    source, path = disk_store
    before = registered_bytes()
    with ExpertStore(path) as es:
        reg = FakeRegistrar()
        # a chunk limit of 2.5 slots: chunks of two slots, never half a slot
        limits = PinLimits(chunk_bytes=source.slot_bytes * 5 // 2 // 4096 * 4096)
        tier = HostTier(es, 5 * source.slot_bytes, pin_memory=True, registrar=reg, pin_limits=limits)
        s, p = tier.slot_bytes, tier.buf.data_ptr()
        assert tier.pinning.pinned and tier.pinning.chunks == [(0, 2 * s), (2 * s, 2 * s), (4 * s, s)]
        assert p % 4096 == 0 and reg.registered == {p: 2 * s, p + 2 * s: 2 * s, p + 4 * s: s}
        # a source's bank() is the device expert cache's (engine.experts.device_cache): not this
        assert not hasattr(tier, "bank")
        monkeypatch.setattr(tier.copier, "copy", lambda *a: pytest.fail("a pinned bank copies straight"))
        out = torch.empty(s, dtype=torch.uint8)
        for key in every_key():
            tier.read_into(key, out)
            assert torch.equal(out[:es.expert_nbytes], source.blob(key)), key
        tier.close()
        tier.close()
        assert sorted(c[1] for c in reg.calls if c[0] == "unregister") == [p, p + 2 * s, p + 4 * s]
        assert not reg.registered and registered_bytes() == before and not tier.pinning.pinned


def test_a_dropped_ram_tier_unregisters_its_block(disk_store):
    import gc

    source, path = disk_store
    with ExpertStore(path) as es:
        reg = FakeRegistrar()
        tier = HostTier(es, 2 * source.slot_bytes, pin_memory=True, registrar=reg)
        assert tier.pinning.pinned and reg.registered
        del tier
        gc.collect()
        assert not reg.registered


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default registers on a CUDA machine")
def test_without_cuda_the_ram_tier_pins_nothing_and_says_nothing(disk_store, caplog):
    source, path = disk_store
    with ExpertStore(path) as es:
        tier = HostTier(es, 2 * source.slot_bytes)
        assert tier.pinning is None
        tier.close()
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_closing_a_store_model_unregisters_its_ram_tier(disk_store):
    from types import SimpleNamespace

    from engine.experts.runtime import StoreModel

    source, path = disk_store
    es = ExpertStore(path)
    reg = FakeRegistrar()
    tier = HostTier(es, 2 * source.slot_bytes, pin_memory=True, registrar=reg)
    cache = SimpleNamespace(source=tier, close=lambda: None)
    assert reg.registered
    StoreModel(model=None, tokenizer=None, cache=cache, store=es).close()
    assert not reg.registered and not tier.pinning.pinned


def test_the_device_cache_sees_whether_the_bank_is_pinned(disk_store):
    """The device expert cache's copy kernel reads the RAM tier through its device address: on a
    GPU it refuses a tier whose pin failed (engine.experts.device_cache._bank_pinned)."""
    from engine.experts.device_cache import _bank_pinned

    source, path = disk_store
    with ExpertStore(path) as es:
        for fail_on, pinned in ((2, False), (None, True)):
            tier = HostTier(es, 4 * source.slot_bytes, pin_memory=True, registrar=FakeRegistrar(fail_on=fail_on),
                            pin_limits=PinLimits(chunk_bytes=source.slot_bytes))
            assert _bank_pinned(tier) is pinned
            tier.close()
        assert _bank_pinned(HostTier(es, 4 * source.slot_bytes, pin_memory=False)) is False
