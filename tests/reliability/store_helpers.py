"""Helpers of the expert-store reliability tests: a tiny checkpoint and store, file-tree
digests, small tmpfs mounts (full and read-only file systems; root ignores file modes)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from engine.quant.formats import QuantFormat
from engine.store import convert
from engine.store.manifest import MANIFEST_NAME
from engine.store.outdir import LOCK_NAME, TMP_SUFFIX
from tests.engine.models.hf_tiny import make_checkpoint
from tests.engine.store.test_store import _add_tokenizer

INT4 = QuantFormat("int4", 32)


def make_source(root: Path) -> Path:
    """A 2-layer, 4-expert Mixtral checkpoint with a tokenizer (expert width 64: int4 g32 fits)."""
    make_checkpoint("mixtral", root, intermediate_size=64)
    _add_tokenizer(root)
    return root


def make_store(src: Path, out: Path) -> Path:
    convert(src, out, fmt=INT4, progress=False)
    return out


def copy_store(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def tree_digests(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``root`` ("<dir>" for directories)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def leftovers(root: Path) -> list[str]:
    """convert's temporary files and lock anywhere under ``root``."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.name == LOCK_NAME or p.name.endswith(TMP_SUFFIX))


def edit_manifest(root: Path, edit) -> dict:
    path = root / MANIFEST_NAME
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))
    return m


def entry(m: dict, layer: int, expert: int) -> dict:
    return next(e for e in m["experts"] if (e["layer"], e["expert"]) == (layer, expert))


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=20)


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (skips the test when mounting is not permitted);
    unmounted on exit."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        res = _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where))
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot run mount: {e}")
    if res.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {res.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=20)


def remount_ro(where: Path) -> None:
    res = _mount("-o", "remount,ro", str(where))
    if res.returncode != 0:
        pytest.skip(f"remounting read-only is not permitted here: {res.stderr.strip()}")
