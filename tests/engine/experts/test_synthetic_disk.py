"""The synthetic store written to disk: a store the normal reader and RAM tier serve with the
RAM source's exact bytes, digests checked; it refuses a directory holding anything not its own,
takes over its own leftovers, and removes exactly what it wrote."""

from __future__ import annotations

import json

import pytest
import torch

from engine.costmodel import SHAPES
from engine.errors import ChecksumError, ConfigError
from engine.experts.synthetic_disk import LEDGER, SyntheticDiskStore
from engine.experts.synthetic_store import SyntheticExpertStore
from engine.experts.tiers import HostTier
from engine.store.reader import ExpertStore

TINY = SHAPES["tiny"]


@pytest.fixture(scope="module")
def source():
    return SyntheticExpertStore(TINY, seed=5).ram_source(pin_memory=False)


def test_store_serves_the_ram_sources_bytes_through_the_tiers(tmp_path, source):
    out = tmp_path / "s"
    with SyntheticDiskStore(source, out) as path:
        assert path == out
        with ExpertStore(path) as es:
            assert es.num_experts_total == TINY.num_experts_total
            assert es.config.moe.num_experts == TINY.experts and es.config.num_layers == TINY.layers
            for layer in range(TINY.layers):
                for e in range(TINY.experts):  # verify=True: the digests bind (layer, expert)
                    assert bytes(es.read_expert(layer, e)) == source.blob((layer, e)).numpy().tobytes()
            es.dense_source()  # sha256 and every tensor the config implies, by shape
            # a RAM tier of 3 slots in front of it: misses are reads of the store
            tier = HostTier(es, 3 * source.slot_bytes, verify=True, pin_memory=False)
            buf = torch.empty(source.slot_bytes, dtype=torch.uint8)
            tiers = [tier.read_into((k % TINY.layers, k % TINY.experts), buf) for k in range(8)]
            assert torch.equal(buf[:source.store.expert_nbytes], source.blob((7 % TINY.layers, 7 % TINY.experts)))
            assert "nvme" in tiers and tier.nvme.bytes_in > 0 and tier.nvme.seconds > 0
        # a flipped byte in a data file is caught by the reader
        f = path / "experts-L001.bin"
        data = bytearray(f.read_bytes())
        data[100] ^= 0xFF
        f.write_bytes(bytes(data))
        with ExpertStore(path) as es, pytest.raises(ChecksumError):
            es.read_expert(1, 0)
    assert not out.exists()  # created by the run: removed with everything in it


def test_refuses_a_directory_with_other_files_and_touches_nothing(tmp_path, source):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        SyntheticDiskStore(source, tmp_path).write()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        SyntheticDiskStore(source, f).write()


def test_a_refused_real_store_keeps_its_files_of_the_same_names(tmp_path, source):
    """--disk pointed at a user's expert store: refused, and the failed enter's clean-up must not
    remove the store's manifest, dense file or layer files (they carry the names it writes)."""
    from engine.experts.synthetic_disk import DENSE_NAME, MANIFEST_NAME
    from engine.store.manifest import layer_file_name

    names = [MANIFEST_NAME, DENSE_NAME, layer_file_name(0), "tokenizer.json"]
    for n in names:
        (tmp_path / n).write_text("the user's")
    with pytest.raises(ConfigError, match="not empty"):
        with SyntheticDiskStore(source, tmp_path):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    assert all((tmp_path / n).read_text() == "the user's" for n in names)


def test_own_leftovers_are_taken_over_but_not_a_stranger_beside_them(tmp_path, source):
    d = tmp_path / "s"
    d.mkdir()  # exists and is empty: used, and left in place afterwards
    with SyntheticDiskStore(source, d):
        pass
    assert d.is_dir() and not any(d.iterdir())
    # a killed run's leftovers: the ledger and a half-written file of ours
    s = SyntheticDiskStore(source, d)
    (d / LEDGER).write_text(json.dumps({"kind": "moestream synthetic store", "names": s.names}))
    (d / "experts-L000.bin.tmp").write_bytes(b"half")
    with s:
        assert not (d / "experts-L000.bin.tmp").exists()
    assert not any(d.iterdir())
    (d / LEDGER).write_text(json.dumps({"kind": "moestream synthetic store", "names": s.names}))
    (d / "keep.bin").write_bytes(b"someone else's")
    with pytest.raises(ConfigError, match="keep.bin"):
        SyntheticDiskStore(source, d).write()
    assert (d / "keep.bin").read_bytes() == b"someone else's"


def test_cleanup_leaves_a_file_added_meanwhile(tmp_path, source):
    out = tmp_path / "s"
    with SyntheticDiskStore(source, out) as path:
        (path / "added.txt").write_text("not ours")
    assert sorted(p.name for p in out.iterdir()) == ["added.txt"]


def test_a_ledger_cannot_make_it_delete_a_stranger(tmp_path, source):
    (tmp_path / LEDGER).write_text(json.dumps({"kind": "moestream synthetic store", "names": ["notes.txt"]}))
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="notes.txt"):
        SyntheticDiskStore(source, tmp_path).write()
    assert (tmp_path / "notes.txt").read_text() == "mine"
