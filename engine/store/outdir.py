"""What ``convert`` may touch in its output directory, and how it cleans up after itself.

Rule: convert writes only inside a directory that does not exist, is empty, or is a moestream
store (it holds a manifest.json or progress.json of ours). Inside a store it creates, replaces
or removes only

- files and directories the store's manifest or progress.json records as written by convert
  (and, for ``tokenizer/``, only the files recorded inside it), whose names are convert's own
  (:func:`store_name`): a manifest cannot make convert delete ``notes.txt``;
- its temporary files (``<store name>.tmp``) and its lock (``.convert.lock``), which are removed
  on every exit path.

Anything else under one of convert's names (a user's ``dense.safetensors`` next to a store, a
user's file inside ``tokenizer/``) makes convert refuse before it writes anything, naming it.
Files with other names are left alone. I/O failures while writing (a full disk, a read-only file
system) become a ConfigError naming the output directory and the file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from engine.errors import ConfigError, ModelFormatError
from engine.store.manifest import (
    DENSE_NAME, MANIFEST_NAME, MAX_MANIFEST_BYTES, TOKENIZER_DIR, StoreManifest, layer_file_name,
    load_manifest,
)

PROGRESS_NAME = "progress.json"
LOCK_NAME = ".convert.lock"
TMP_SUFFIX = ".tmp"
_LAYER_FILE = re.compile(r"experts-L\d{3,}\.bin")
_PLE_FILE = re.compile(r"ple-layer-\d{3,}\.rows")  # engine.store.ple_store.ple_file_name
_FIXED_NAMES = frozenset({MANIFEST_NAME, PROGRESS_NAME, DENSE_NAME, TOKENIZER_DIR})
# What transformers' save_pretrained writes for a tokenizer (plus the generation config convert
# copies). Stores of schema 1 did not list their tokenizer files; these names are theirs.
_LEGACY_TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja",
    "chat_template.json", "generation_config.json",
})
_MAX_LISTED = 5  # names quoted in a refusal


def store_name(name: str) -> bool:
    """A top-level name convert writes (the only names it ever creates, replaces or removes)."""
    return (name in _FIXED_NAMES or _LAYER_FILE.fullmatch(name) is not None
            or _PLE_FILE.fullmatch(name) is not None)


def tmp_name(name: str) -> bool:
    """A temporary file of convert: ``<store name>.tmp``."""
    return name.endswith(TMP_SUFFIX) and store_name(name[:-len(TMP_SUFFIX)])


def _listing(names: list[str]) -> str:
    names = sorted(names)
    more = f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


# --------------------------------------------------------------------------------- inspection

def _read_ours(path: Path, keys: frozenset[str]) -> dict[str, Any] | None:
    """The JSON object in ``path`` if it is a regular file shaped like ours (has ``keys``)."""
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > MAX_MANIFEST_BYTES:
            return None
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return raw if isinstance(raw, dict) and keys <= raw.keys() else None


_MANIFEST_KEYS = frozenset({"schema_version", "quant", "dense", "experts"})
_PROGRESS_KEYS = frozenset({"version", "params", "layers"})


@dataclass
class OutDir:
    """What an existing output directory holds, as far as convert is concerned."""

    path: Path
    manifest_raw: dict[str, Any] | None = None  # a manifest.json of ours (maybe invalid)
    manifest: StoreManifest | None = None  # ... parsed and valid for this moestream
    manifest_problem: str | None = None  # ... or why not
    progress: dict[str, Any] | None = None  # a progress.json of ours
    owned: set[str] = field(default_factory=set)  # top-level names recorded as ours
    tokenizer_owned: set[str] = field(default_factory=set)  # file names inside tokenizer/

    @property
    def is_store(self) -> bool:
        return self.manifest_raw is not None or self.progress is not None

    def foreign(self) -> list[str]:
        """Entries under convert's names that the store does not record as its own: convert
        would overwrite or remove them, so it refuses instead."""
        found = []
        for p in self.path.iterdir():
            name = p.name
            if name == LOCK_NAME or (tmp_name(name) and self.is_store):
                continue
            if name not in self.owned:
                if store_name(name):
                    found.append(name)
                continue
            is_dir = p.is_dir() and not p.is_symlink()
            if name == TOKENIZER_DIR and is_dir:
                found += [f"{name}/{c.name}" for c in p.iterdir()
                          if c.name not in self.tokenizer_owned or not c.is_file() or c.is_symlink()]
            elif is_dir or name == TOKENIZER_DIR:
                found.append(name + ("/" if is_dir else ""))
        return found


def _recorded(raw: dict[str, Any], *paths: tuple[str, ...]) -> list[Any]:
    """Values at the given key paths of a JSON object (missing or mistyped ones skipped)."""
    out = []
    for keys in paths:
        v: Any = raw
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        if v is not None:
            out.append(v)
    return out


def _ple_files(raw: dict[str, Any]) -> set[str]:
    """The PLE row files a manifest or progress records (``ple_tables``: [{file, ...}])."""
    tables = raw.get("ple_tables")
    return {str(t["file"]) for t in tables if isinstance(t, dict) and _PLE_FILE.fullmatch(str(t.get("file")))} \
        if isinstance(tables, list) else set()


def _owned_by_manifest(raw: dict[str, Any]) -> tuple[set[str], set[str]]:
    names = {MANIFEST_NAME, *_recorded(raw, ("dense", "file"), ("tokenizer_dir",)), *_ple_files(raw)}
    files = raw.get("data_files")
    names |= set(files) if isinstance(files, dict) else set()
    tok = raw.get("tokenizer_files")
    tok_files = set(tok) if isinstance(tok, dict) else set()
    if raw.get("schema_version") == 1:
        tok_files |= _LEGACY_TOKENIZER_FILES
    return names, tok_files


def _owned_by_progress(raw: dict[str, Any]) -> tuple[set[str], set[str]]:
    names = {PROGRESS_NAME, *_recorded(raw, ("dense", "file")), *_ple_files(raw)}
    layers = raw.get("layers")
    if isinstance(layers, dict):
        names |= {layer_file_name(int(k)) for k in layers if isinstance(k, str) and k.isdigit()
                  and len(k) < 10}
    tok = _recorded(raw, ("tokenizer", "files"))
    tok_files = set(tok[0]) if tok and isinstance(tok[0], dict) else set()
    if tok_files:
        names.add(TOKENIZER_DIR)
    if raw.get("version") == 1:
        tok_files |= _LEGACY_TOKENIZER_FILES
        names.add(TOKENIZER_DIR)
    stale = raw.get("stale")  # parts of a conversion being replaced (writer._start_over)
    if isinstance(stale, dict):
        for key, into in (("names", names), ("tokenizer_files", tok_files)):
            listed = stale.get(key)
            into |= {x for x in listed if isinstance(x, str)} if isinstance(listed, list) else set()
    return names, tok_files


def inspect(out: Path) -> OutDir:
    """Read the markers of an existing output directory (writes nothing)."""
    d = OutDir(out)
    d.manifest_raw = _read_ours(out / MANIFEST_NAME, _MANIFEST_KEYS)
    d.progress = _read_ours(out / PROGRESS_NAME, _PROGRESS_KEYS)
    for raw, owned_by in ((d.manifest_raw, _owned_by_manifest), (d.progress, _owned_by_progress)):
        if raw is not None:
            names, tok_files = owned_by(raw)
            d.owned |= {n for n in names if isinstance(n, str) and store_name(n)}
            d.tokenizer_owned |= {n for n in tok_files if isinstance(n, str)}
    if d.manifest_raw is not None:
        try:
            d.manifest = load_manifest(out)
        except ModelFormatError as e:
            d.manifest_problem = str(e)
    return d


def check_out_path(out: Path) -> None:
    """``out`` and every directory above it that exists must be directories."""
    for p in (out, *out.parents):
        try:
            st = p.stat()
        except FileNotFoundError:
            if p.is_symlink():
                raise ConfigError(f"--out {out}: {p} is a dangling symbolic link") from None
            continue
        except NotADirectoryError:  # something above p is not a directory: found further up
            continue
        if stat.S_ISDIR(st.st_mode):
            return
        what = "a regular file" if stat.S_ISREG(st.st_mode) else "not a directory"
        if p == out:
            raise ConfigError(f"--out {out} exists and is {what}; choose a directory")
        raise ConfigError(f"--out {out}: {p} is {what}, so no directory can be created under it")


def refuse_unless_store(out: Path) -> None:
    """Convert writes only into a new or empty directory or a moestream store; checked before
    anything (its lock included) is created there."""
    if not out.is_dir():
        return
    others = [p.name for p in out.iterdir() if p.name != LOCK_NAME]
    if others and not inspect(out).is_store:
        raise ConfigError(
            f"--out {out} is not empty and is not a moestream store (it holds {_listing(others)}); "
            f"convert writes only into a new or empty directory or an existing store, and "
            f"--overwrite replaces only a store; choose another --out")


def refuse_foreign(d: OutDir) -> None:
    foreign = d.foreign()
    if foreign:
        raise ConfigError(
            f"--out {d.path} holds {_listing(foreign)}, which this store does not record as written "
            f"by moestream convert; convert would overwrite or remove them, so it stops: move them "
            f"away or choose another --out")


# ------------------------------------------------------------------------------------ writing

def remove_tokenizer_dir(path: Path, owned: set[str]) -> None:
    """Remove the files of ``owned`` inside ``path``, then the directory if nothing else is left."""
    if not (path.exists() or path.is_symlink()):
        return
    if not path.is_dir() or path.is_symlink():
        raise ConfigError(f"--out {path.parent}: {path.name} is not a directory convert wrote; "
                          f"move it away")
    for child in path.iterdir():
        if child.name in owned and (child.is_file() or child.is_symlink()):
            child.unlink()
    try:
        path.rmdir()
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise ConfigError(f"--out {path.parent}: {path.name}/ holds files convert did not write; "
                          f"move them away") from None


def remove_owned(d: OutDir) -> None:
    """Remove everything the store records as convert's: the manifest first, so that the
    directory never looks finished meanwhile."""
    order = sorted(d.owned, key=lambda n: n != MANIFEST_NAME)
    for name in order:
        p = d.path / name
        if name == TOKENIZER_DIR:
            remove_tokenizer_dir(p, d.tokenizer_owned)
        elif not p.is_dir() or p.is_symlink():
            p.unlink(missing_ok=True)
        if name == MANIFEST_NAME:
            fsync_dir(d.path)
    d.owned.clear()
    d.tokenizer_owned.clear()


def remove_tmp(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cleanup(out: Path) -> None:
    """Temporary files, then the lock: best effort (the file system may have gone read-only)."""
    with contextlib.suppress(OSError):
        for p in list(out.iterdir()):
            if tmp_name(p.name):
                with contextlib.suppress(OSError):
                    remove_tmp(p)
    with contextlib.suppress(OSError):
        (out / LOCK_NAME).unlink(missing_ok=True)


def _busy(out: Path) -> ConfigError:
    return ConfigError(f"{out}: another moestream convert is writing to this store; wait for it "
                       f"to finish")


@contextlib.contextmanager
def exclusive(out: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``out/.convert.lock``; on exit (any exit) convert's temporary
    files and the lock file are removed while the lock is still held."""
    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(out) from None
        try:
            st, now = os.fstat(fd), os.stat(path)
        except FileNotFoundError:
            raise _busy(out) from None  # a finishing convert removed the file we opened
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
            raise _busy(out)
        try:
            yield
        finally:
            _cleanup(out)
    finally:
        os.close(fd)


def make_dirs(out: Path) -> list[Path]:
    """Create ``out`` and missing parents; returns the directories created, outermost first."""
    missing = [p for p in (out, *out.parents) if not p.exists()]
    created = []
    for p in reversed(missing):
        p.mkdir()
        created.append(p)
    return created


def remove_if_empty(dirs: list[Path]) -> None:
    for p in reversed(dirs):
        with contextlib.suppress(OSError):
            p.rmdir()


_REASONS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted", errno.EFBIG: "file too large"}


def io_problem(out: Path, e: OSError) -> str:
    reason = _REASONS.get(e.errno or 0, e.strerror or type(e).__name__)
    target = e.filename2 or e.filename  # copies report (source, destination)
    where = f" ({target})" if target else ""
    hint = ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = ("; temporary files were removed and finished parts kept: free space and run "
                "convert again to resume, or delete the directory")
    return f"--out {out}: writing the store failed{where}: {reason}{hint}"


@contextlib.contextmanager
def io_errors(out: Path) -> Iterator[None]:
    """OSError while writing -> ConfigError naming ``out`` (and the file, the reason)."""
    try:
        yield
    except OSError as e:
        raise ConfigError(io_problem(out, e)) from None


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


@contextlib.contextmanager
def library_io(path: Path) -> Iterator[None]:
    """Libraries written in Rust (safetensors, tokenizers) report an I/O error as a plain
    exception whose message ends "(os error N)": turn that back into OSError(N) on ``path``."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:
        found = _RUST_OS_ERROR.search(str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


__all__ = ["LOCK_NAME", "PROGRESS_NAME", "TMP_SUFFIX", "OutDir", "check_out_path", "exclusive",
           "fsync_dir", "inspect", "io_errors", "library_io", "make_dirs", "refuse_foreign", "refuse_unless_store",
           "remove_if_empty", "remove_owned", "remove_tmp", "remove_tokenizer_dir", "store_name",
           "tmp_name"]
