"""Class 1: ``convert`` touches only what it wrote.

It writes only into a new or empty directory or a moestream store, refuses anything else
(--overwrite included) before creating anything there, replaces under --overwrite only what the
store records as its own, and leaves no temporary file or lock behind on any exit path (an
exception mid-write, a full disk, a read-only file system). Every check compares the digests of
every user file before and after.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine.errors import ConfigError
from engine.quant.formats import QuantFormat
from engine.store import ExpertStore, convert, verify_store
from engine.store.outdir import LOCK_NAME, PROGRESS_NAME
from tests.reliability.store_helpers import (
    INT4, leftovers, remount_ro, tmpfs, tree_digests,
)

NF4 = QuantFormat("nf4", 32)


def _user_files(root: Path) -> None:
    """A user's directory whose names collide with convert's outputs."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "dense.safetensors").write_bytes(b"my own dense weights")
    (root / "experts-L000.bin").write_bytes(bytes(range(256)) * 3)
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text('{"mine": true}')
    (root / "notes.txt").write_text("keep me")


@pytest.mark.parametrize("overwrite", [False, True])
def test_foreign_directory_is_refused_untouched(src, tmp_path, overwrite):
    out = tmp_path / "mine"
    _user_files(out)
    before = tree_digests(out)
    with pytest.raises(ConfigError, match=rf"--out {re.escape(str(out))} is not empty and is not a "
                                          rf"moestream store \(it holds dense\.safetensors, "):
        convert(src, out, fmt=INT4, progress=False, overwrite=overwrite)
    assert tree_digests(out) == before  # every byte intact, no lock file created
    assert leftovers(out) == []


def test_cli_refusal_is_one_error_line(src, tmp_path):
    from services.cli import main

    out = tmp_path / "mine"
    _user_files(out)
    before = tree_digests(out)
    res = CliRunner().invoke(main, ["convert", str(src), "--out", str(out), "--group-size", "32",
                                   "--no-progress", "--overwrite"])
    assert res.exit_code == 2
    assert res.output.startswith(f"error: --out {out} is not empty") and res.output.count("\n") == 1
    assert "Traceback" not in res.output
    assert tree_digests(out) == before


def test_overwrite_never_removes_foreign_files(src, store, tmp_path):
    import shutil

    out = tmp_path / "s"
    shutil.copytree(store, out)
    (out / "notes.txt").write_text("mine, beside the store")
    (out / "tokenizer" / "my_vocab.txt").write_text("mine, inside a folder convert writes")
    before = tree_digests(out)
    with pytest.raises(ConfigError, match=r"holds tokenizer/my_vocab\.txt, which this store does not "
                                          r"record as written by moestream convert"):
        convert(src, out, fmt=NF4, progress=False, overwrite=True)
    assert tree_digests(out) == before and leftovers(out) == []

    (out / "tokenizer" / "my_vocab.txt").unlink()
    s = convert(src, out, fmt=NF4, progress=False, overwrite=True)
    assert s.quant == "nf4 g32" and s.layers_converted == 2
    assert (out / "notes.txt").read_text() == "mine, beside the store"
    assert leftovers(out) == [] and verify_store(out).ok
    with ExpertStore(out) as st:
        assert st.fmt == NF4
        assert sorted(p.name for p in (out / "tokenizer").iterdir()) == sorted(st.manifest.tokenizer_files)


def test_unrecorded_file_under_a_store_name_is_refused(src, store, tmp_path):
    import shutil

    out = tmp_path / "s"
    shutil.copytree(store, out)
    (out / "experts-L007.bin").write_bytes(b"not the store's")
    before = tree_digests(out)
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match=r"holds experts-L007\.bin, which this store does not record"):
            convert(src, out, fmt=NF4, progress=False, overwrite=overwrite)
        assert tree_digests(out) == before and leftovers(out) == []


def test_exception_mid_write_leaves_no_temporary_files(src, tmp_path, monkeypatch):
    import engine.quant.expert_blob as formats

    real, calls = formats.pack_expert, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 6:  # second layer, second expert: its temporary file is half written
            raise OSError(5, "Input/output error")
        return real(*args, **kw)

    monkeypatch.setattr(formats, "pack_expert", failing)
    out = tmp_path / "s"
    with pytest.raises(ConfigError, match=rf"--out {re.escape(str(out))}: writing the store failed: "
                                          rf"Input/output error"):
        convert(src, out, fmt=INT4, progress=False)
    assert leftovers(out) == []
    prog = json.loads((out / PROGRESS_NAME).read_text())  # what is left is recorded: resumable
    assert sorted(p.name for p in out.iterdir()) == ["dense.safetensors", "experts-L000.bin",
                                                     "progress.json", "tokenizer"]
    assert list(prog["layers"]) == ["0"]
    monkeypatch.setattr(formats, "pack_expert", real)
    s = convert(src, out, fmt=INT4, progress=False)
    assert (s.layers_reused, s.layers_converted) == (1, 1) and verify_store(out).ok


def test_keyboard_interrupt_leaves_no_lock_or_temporary_files(src, tmp_path, monkeypatch):
    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr("safetensors.torch.save_file", interrupted)  # while writing dense
    out = tmp_path / "s"
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, fmt=INT4, progress=False)
    assert leftovers(out) == []
    assert sorted(p.name for p in out.iterdir()) == ["progress.json", "tokenizer"]


@pytest.mark.parametrize("under", ["file", "file/deeper"])
def test_output_under_a_regular_file(src, tmp_path, under):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"a regular file")
    out = tmp_path / under / "store"
    with pytest.raises(ConfigError, match=rf"--out {re.escape(str(out))}: {re.escape(str(blocker))} is "
                                          rf"a regular file, so no directory can be created under it"):
        convert(src, out, fmt=INT4, progress=False)
    with pytest.raises(ConfigError, match=rf"--out {re.escape(str(blocker))} exists and is a regular file"):
        convert(src, blocker, fmt=INT4, progress=False)
    assert blocker.read_bytes() == b"a regular file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_success_and_noop_leave_no_lock(src, tmp_path):
    out = tmp_path / "s"
    convert(src, out, fmt=INT4, progress=False)
    assert leftovers(out) == [] and not (out / LOCK_NAME).exists()
    again = convert(src, out, fmt=INT4, progress=False)
    assert again.already_done and leftovers(out) == []


# Sizes that run out in different places: the tokenizer or dense file, a layer, the manifest.
@pytest.mark.parametrize("size", ["8k", "40k", "96k", "128k"])
def test_full_disk_is_a_typed_error_with_user_files_intact(src, tmp_path, size):
    with tmpfs(tmp_path / "mnt", size) as mnt:
        (mnt / "mine.bin").write_bytes(b"\x5a" * 4000)
        out = mnt / "store"
        before = tree_digests(mnt)
        with pytest.raises(ConfigError, match=rf"--out {re.escape(str(out))}: writing the store failed"
                                              rf".*no space left on the device; temporary files were "
                                              rf"removed"):
            convert(src, out, fmt=INT4, progress=False)
        assert (mnt / "mine.bin").read_bytes() == b"\x5a" * 4000
        assert {k: v for k, v in tree_digests(mnt).items() if not k.startswith("store")} == before
        assert leftovers(mnt) == []
        if out.exists():  # only parts recorded in progress.json remain (a resumable state)
            prog = json.loads((out / PROGRESS_NAME).read_text())
            recorded = {"progress.json"} | {f"experts-L{int(k):03d}.bin" for k in prog["layers"]}
            recorded |= {"dense.safetensors"} if prog["dense"] else set()
            recorded |= {"tokenizer"} if prog["tokenizer"] else set()
            assert {p.name for p in out.iterdir()} <= recorded


def test_read_only_file_system(src, tmp_path):
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        (mnt / "mine.bin").write_bytes(b"keep")
        (mnt / "empty").mkdir()
        remount_ro(mnt)
        before = tree_digests(mnt)
        for out in (mnt / "empty", mnt / "new" / "store"):
            with pytest.raises(ConfigError, match=rf"--out {re.escape(str(out))}: writing the store "
                                                  rf"failed .*: read-only file system"):
                convert(src, out, fmt=INT4, progress=False)
        assert tree_digests(mnt) == before


def test_overwrite_killed_midway_can_be_run_again(src, store, tmp_path, monkeypatch):
    import shutil

    import engine.store.outdir as outdir

    out = tmp_path / "s"
    shutil.copytree(store, out)
    (out / "notes.txt").write_text("mine")

    def killed(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(outdir, "remove_tokenizer_dir", killed)
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, fmt=NF4, progress=False, overwrite=True)
    assert not (out / "manifest.json").exists() and (out / "tokenizer").is_dir()
    monkeypatch.undo()
    s = convert(src, out, fmt=NF4, progress=False)  # what is left is still recorded as ours
    assert s.quant == "nf4 g32" and verify_store(out).ok and leftovers(out) == []
    assert (out / "notes.txt").read_text() == "mine"


def test_concurrent_convert_is_refused_and_keeps_the_other_lock(src, store, tmp_path):
    import fcntl
    import os
    import shutil

    out = tmp_path / "s"
    shutil.copytree(store, out)
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another convert at work
        with pytest.raises(ConfigError, match=rf"{re.escape(str(out))}: another moestream convert is "
                                              rf"writing to this store"):
            convert(src, out, fmt=INT4, progress=False)
        assert (out / LOCK_NAME).exists()
    finally:
        os.close(fd)
    assert convert(src, out, fmt=INT4, progress=False).already_done
    assert leftovers(out) == []
