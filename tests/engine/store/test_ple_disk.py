"""The PLE tier: row files and DiskPLETable against the in-memory table (the reference)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from engine.errors import ConfigError, ExpertLoadError, ModelFormatError
from engine.store import ple_disk
from engine.store.ple_disk import DiskPLETable, PLETier
from engine.store.ple_rows import (PAGE_ALIGN, PLERowChecksumError, RowLayout, decode_rows, encode_rows,
                                   read_layout, row_chunks, write_row_file)


def _table(rows: int, dim: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, dim, generator=g).to(dtype)


def _reference(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """InMemoryPLETable's gather: index the whole table, fp32."""
    return table[ids].float()


def _write(tmp_path, table, dtype, name="ple0.rows", chunk=1000):
    path = tmp_path / name
    write_row_file(path, row_chunks(table, chunk), table.shape[0], table.shape[1], dtype)
    return path


@pytest.mark.parametrize("dtype,tdtype,dim", [("fp32", torch.float32, 24), ("bf16", torch.bfloat16, 64),
                                              ("fp16", torch.float16, 3000), ("fp8_e4m3", torch.float8_e4m3fn, 40)])
def test_checkpoint_precision_is_exact(tmp_path, dtype, tdtype, dim):
    table = _table(5003, dim, seed=1, dtype=tdtype)
    path = _write(tmp_path, table, dtype, chunk=777)
    tier = PLETier(budget_bytes=64 * 1024)
    (t,) = tier.open_tables([path])
    g = torch.Generator().manual_seed(2)
    for step in range(6):
        ids = torch.randint(0, table.shape[0], (7, 3), generator=g)
        if step % 2:
            t.prefetch(ids)
        torch.testing.assert_close(t.gather(ids), _reference(table, ids), rtol=0, atol=0)
    tier.close()


def test_int8_within_bound_of_fp32(tmp_path):
    table = _table(4099, 96, seed=3) * torch.linspace(0.01, 10, 4099)[:, None]
    path = _write(tmp_path, table, "int8")
    tier = PLETier(budget_bytes=0)
    (t,) = tier.open_tables([path])
    ids = torch.arange(table.shape[0])
    got = t.gather(ids)
    bound = table.abs().amax(dim=1, keepdim=True) / 254 * (1 + 1e-5)
    assert ((got - table).abs() <= bound).all()
    assert (got - table).abs().max() > 0  # really quantized
    torch.testing.assert_close(decode_rows(encode_rows(table, "int8"), t.layout), got, rtol=0, atol=0)
    tier.close()


def test_small_cache_prefetch_and_ledger(tmp_path):
    table = _table(20000, 32, seed=4, dtype=torch.bfloat16)
    path = _write(tmp_path, table, "bf16")
    layout = read_layout(path)
    budget = 50 * layout.row_bytes  # 50 rows of 20,000
    tier = PLETier(budget_bytes=budget)
    (t,) = tier.open_tables([path])
    assert t.slots == 50
    c = tier.counters
    g = torch.Generator().manual_seed(5)
    hot = torch.randint(0, 20000, (4,), generator=g)
    for step in range(40):
        ids = torch.cat([hot, torch.randint(0, 20000, (12,), generator=g)]).reshape(4, 4)
        t.prefetch(ids)
        torch.testing.assert_close(t.gather(ids), _reference(table, ids), rtol=0, atol=0)
    uniq = c.lookups
    assert c.cache_hits + c.prefetched + c.sync_reads == uniq
    assert c.sync_reads == 0  # every miss was prefetched
    assert c.cache_hits >= 4 * 39  # the hot rows stay cached
    assert c.bytes_read == c.pages_read * layout.page_bytes
    s = c.summary(tokens=40)
    assert s["ple_rows_per_token"] == uniq / 40 and s["ple_bytes_per_token"] == c.bytes_read / 40
    assert 0 < s["ple_hit_rate"] < 1
    assert len(t._where) <= 50
    tier.close()


def test_no_prefetch_reads_synchronously_and_cache_hits(tmp_path):
    table = _table(3000, 16, seed=6)
    path = _write(tmp_path, table, "fp32")
    tier = PLETier(budget_bytes=1 << 20)
    (t,) = tier.open_tables([path])
    ids = torch.tensor([[5, 2999, 5], [0, 17, 1200]])
    torch.testing.assert_close(t.gather(ids), _reference(table, ids))
    assert (tier.counters.sync_reads, tier.counters.cache_hits, tier.counters.lookups) == (5, 0, 5)
    torch.testing.assert_close(t.gather(ids), _reference(table, ids))
    assert (tier.counters.sync_reads, tier.counters.cache_hits) == (5, 5)
    tier.close()


def test_unused_prefetch_is_counted_wasted(tmp_path):
    table = _table(3000, 16, seed=7)
    path = _write(tmp_path, table, "fp32")
    tier = PLETier(budget_bytes=0)
    (t,) = tier.open_tables([path])
    t.prefetch(torch.tensor([1, 2000]))
    for f in list(t._pending.values()):
        f.result()
    t.prefetch(torch.tensor([5]))  # the step that prefetched rows 1, 2000 never gathered them
    assert tier.counters.wasted_pages == 2
    torch.testing.assert_close(t.gather(torch.tensor([5])), _reference(table, torch.tensor([5])))
    tier.close()


def test_buffered_fallback_said_once(tmp_path, caplog, monkeypatch):
    table = _table(1000, 8, seed=8)
    paths = [_write(tmp_path, table, "fp32", name=f"ple{i}.rows") for i in range(2)]
    real_open = os.open

    def refuse_direct(path, flags, *a):
        if flags & ple_disk._O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(ple_disk, "_O_DIRECT", 0x4000)
    monkeypatch.setattr(ple_disk.os, "open", refuse_direct)
    monkeypatch.setattr(ple_disk, "_REFUSED_SAID", set())
    with caplog.at_level(logging.WARNING, logger=ple_disk.__name__):
        tier = PLETier()
        tables = tier.open_tables(paths)
    assert [t.direct_io for t in tables] == [False, False]
    assert sum("O_DIRECT refused" in r.message for r in caplog.records) == 1
    ids = torch.tensor([3, 999])
    torch.testing.assert_close(tables[1].gather(ids), _reference(table, ids))
    tier.close()


def _fp32_file(tmp_path, seed: int):
    """A 5000 x 32 fp32 table, its row file and the file's layout."""
    table = _table(5000, 32, seed=seed)
    path = _write(tmp_path, table, "fp32")
    return table, path, read_layout(path)


def test_shorter_than_declared_vocab(tmp_path):
    table, path, lay = _fp32_file(tmp_path, seed=9)
    with open(path, "r+b") as f:
        f.truncate(lay.file_bytes - lay.page_bytes)
    with pytest.raises(ModelFormatError, match="shorter than its declared 5000 rows"):
        PLETier().open_tables([path])
    # a whole file of fewer rows than the model's vocab
    short = _write(tmp_path, table[:4000], "fp32", name="short.rows")
    with pytest.raises(ModelFormatError, match="shorter than its declared vocab"):
        PLETier().open_tables([short], expect=[RowLayout(5000, 32, "fp32")])


def test_truncated_after_open_is_typed(tmp_path):
    _, path, _ = _fp32_file(tmp_path, seed=10)
    tier = PLETier(budget_bytes=0)
    (t,) = tier.open_tables([path])
    os.truncate(path, PAGE_ALIGN * 3)
    with pytest.raises(ExpertLoadError, match="short read"):
        t.gather(torch.tensor([4999]))
    tier.close()


def test_corrupt_page_and_header(tmp_path):
    table, path, lay = _fp32_file(tmp_path, seed=11)
    with open(path, "r+b") as f:
        f.seek(lay.page_offset(3) + 100)
        f.write(b"\xff\xfe")
    tier = PLETier(budget_bytes=0)
    (t,) = tier.open_tables([path])
    row = 3 * lay.rows_per_page
    torch.testing.assert_close(t.gather(torch.tensor([0])), table[:1])
    with pytest.raises(PLERowChecksumError, match="page 3"):
        t.gather(torch.tensor([row]))
    tier.close()
    with open(path, "r+b") as f:
        f.write(b"NOTPLE!!")
    with pytest.raises(ModelFormatError, match="not a PLE row file"):
        read_layout(path)


def test_bad_inputs(tmp_path):
    table = _table(100, 8, seed=12)
    path = _write(tmp_path, table, "fp32")
    tier = PLETier()
    (t,) = tier.open_tables([path])
    with pytest.raises(ConfigError, match="out of range"):
        t.gather(torch.tensor([100]))
    with pytest.raises(ConfigError, match="queue depth"):
        PLETier(queue_depth=4)
    with pytest.raises(ModelFormatError, match="more than the declared"):
        write_row_file(tmp_path / "x.rows", [table, table], 100, 8, "fp32")
    with pytest.raises(ModelFormatError, match="has 50 rows"):
        write_row_file(tmp_path / "y.rows", [table[:50]], 100, 8, "fp32")
    assert not (tmp_path / "y.rows").exists() and not (tmp_path / "y.rows.tmp").exists()
    tier.close()
