"""The PLE tier in a converted store: a tiny random qwen4_exp whose n-gram tables are read from
row files under a row cache far smaller than the table gives the tokens and logits of the same
store with its tables all in RAM (InMemoryPLETable, the reference), and the ledger counts it."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ModelFormatError
from engine.experts.runtime import load_from_store
from engine.layers.sampler import SamplingConfig
from engine.models.qwen4_exp.ple_table import InMemoryPLETable
from engine.quant.formats import QuantFormat
from engine.runner import stream_request
from engine.store import convert
from engine.store.ple_disk import DiskPLETable
from engine.store.ple_rows import load_row_file, read_layout
from engine.store.reader import ExpertStore
from tests.engine.models.qwen4_exp_tiny import make_qwen4_exp, prompt


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("q4ple")
    make_qwen4_exp(d / "ckpt", seed=3, case="ple2_ng3_hc2", moe_intermediate_size=32, vision=False)
    out = {}
    for ple in ("checkpoint", "int8"):
        convert(d / "ckpt", d / ple, fmt=QuantFormat("int4", 32), progress=False, ple_dtype=ple)
        out[ple] = d / ple
    return out


def _run(sm, ids, n=32):
    toks = []
    for out, _ in stream_request(sm.model, ids, SamplingConfig(max_tokens=n, temperature=0.0, ignore_eos=True)):
        toks += out.new_token_ids
    return toks


@pytest.mark.parametrize("ple", ["checkpoint", "int8"])
def test_disk_tier_tokens_match_all_in_ram(stores, ple):
    store = stores[ple]
    m = ExpertStore(store).manifest
    assert [t.dtype for t in m.ple_tables] == (["fp32", "fp32"] if ple == "checkpoint" else ["int8", "int8"])
    table_bytes = sum(read_layout(store / t.file).num_rows * read_layout(store / t.file).row_bytes
                      for t in m.ple_tables)
    budget = table_bytes // 40  # a few rows per layer
    ids = prompt(96, 48)
    with load_from_store(store, ple_budget=budget) as sm:
        tables = sm.model.ple_tables
        assert all(isinstance(t, DiskPLETable) for t in tables) and all(0 < t.slots < t.num_rows // 20 for t in tables)
        assert not any("ngram" in n for n, _ in sm.model.named_parameters())  # nothing of the table in the model
        got = _run(sm, ids)
        s = sm.cache.metrics.summary()
        c = sm.ple.counters
    with load_from_store(store) as ref:
        ref.model.ple_tables = [InMemoryPLETable(load_row_file(store / t.file)) for t in m.ple_tables]
        want = _run(ref, ids)
    assert len(got) == 32 and got == want
    assert c.prefetched > 0 and c.sync_reads == 0  # every row read was prefetched before its layer
    assert c.cache_hits > 0 and c.lookups == c.cache_hits + c.prefetched
    assert s["ple_rows_read"] == c.prefetched and s["ple_bytes_read"] == c.bytes_read > 0


def test_int8_store_close_to_checkpoint_precision(stores):
    m = ExpertStore(stores["int8"]).manifest
    for t in m.ple_tables:
        exact, q = load_row_file(stores["checkpoint"] / t.file), load_row_file(stores["int8"] / t.file)
        bound = exact.abs().amax(dim=1, keepdim=True) / 254 * (1 + 1e-5)
        assert ((q - exact).abs() <= bound).all()


def test_store_with_short_row_file_is_refused(stores, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(stores["checkpoint"], bad)
    f = bad / ExpertStore(bad).manifest.ple_tables[1].file
    lay = read_layout(f)
    with open(f, "r+b") as fh:
        fh.truncate(lay.file_bytes - 1)
    with pytest.raises(ModelFormatError, match="shorter than its declared"):
        ExpertStore(bad)


def test_generate_line_and_metrics_show_ple(stores):
    """generate's figures line and /metrics carry the PLE tier's rows, bytes and hit rate."""
    from services.cli import _cache_line
    from services.http.metrics import Metrics

    with load_from_store(stores["checkpoint"], ple_budget=4096) as sm:
        _run(sm, prompt(96, 20), n=6)
        line = _cache_line(sm, 26)
        summary = sm.cache.metrics.summary(sm.cache.source.counters())
    assert "PLE " in line and "rows/token" in line and "row-cache hit rate" in line
    assert summary["ple_rows_per_token"] == summary["ple_lookups"] / 26 > 0
    text = Metrics().render({"decode": {"cache": summary}}).decode()
    assert f"moestream_ple_rows_per_token {float(summary['ple_rows_per_token'])}" in text
    assert f"moestream_ple_read_bytes_total {float(summary['ple_bytes_read'])}" in text
    assert "moestream_ple_row_cache_hit_rate" in text


def test_verify_checks_row_files_and_reconvert_is_a_no_op(stores, tmp_path):
    import shutil

    from engine.store.ple_rows import read_layout
    from engine.store.verify import verify_store

    good = verify_store(stores["int8"])
    assert good.ok and good.ple_files_checked == 2, good.problems
    again = convert(stores["int8"].parent / "ckpt", stores["int8"], fmt=QuantFormat("int4", 32), progress=False,
                    ple_dtype="int8")
    assert again.already_done
    bad = tmp_path / "bad"
    shutil.copytree(stores["int8"], bad)
    f = bad / ExpertStore(bad).manifest.ple_tables[0].file
    lay = read_layout(f)
    with open(f, "r+b") as fh:
        fh.seek(lay.page_offset(lay.num_pages - 1) + 7)
        fh.write(b"\x55\xaa")
    rep = verify_store(bad)
    assert not rep.ok and rep.ple_files_checked == 1
    assert any(f"page {lay.num_pages - 1}" in p for p in rep.problems), rep.problems


def test_a_ple_stores_dense_source_releases_converted_weights(stores, monkeypatch):
    """The PLE store's dense source (its tables as meta stand-ins) passes on what the plain one
    does: a quantized weight's file pages are released after conversion (it once hid the
    release: every converted weight's pages stayed mapped)."""
    from engine.quant import linear

    released = []
    real = linear.quantize_dense

    def spy(model, dense, head=None, release=None):
        def counting(t):
            ok = release(t)
            released.append(ok)
            return ok
        return real(model, dense, head=head, release=counting if release else None)

    monkeypatch.setattr("engine.experts.runtime.quantize_dense", spy)
    with load_from_store(stores["int8"], dense="int8", prefetch_depth=0) as sm:
        assert released and all(released)
        _run(sm, prompt(sm.model.config.vocab_size, 6), n=2)  # released pages fault back in if read: still runs
