"""Confine the files a checkpoint names to the checkpoint's own directory.

A checkpoint directory is untrusted input: ``model.safetensors.index.json`` names shard files,
and any file in the directory may be a symlink. Every path moestream opens for a checkpoint is
resolved (symlinks followed) and must stay inside the directory, so a crafted checkpoint cannot
make the loader open (and echo errors about) files it does not contain, such as ``/etc/shadow``
or another user's model.

One layout is allowed to leave the directory: the Hugging Face hub cache, where
``models--org--name/snapshots/<revision>/`` holds symlinks into ``models--org--name/blobs/``.
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import ModelFormatError, quote

_HF_CACHE_SNAPSHOTS = "snapshots"
_HF_CACHE_BLOBS = "blobs"


def _allowed_roots(root: Path) -> tuple[Path, ...]:
    real = root.resolve()
    roots = [real]
    if root.parent.name == _HF_CACHE_SNAPSHOTS:
        roots.append((root.parent.parent / _HF_CACHE_BLOBS).resolve())
    return tuple(roots)


def confine(root: Path, name: str, named_by: Path | None = None) -> Path:
    """``root / name`` if it resolves inside ``root`` (or the hub cache's blobs); else
    ModelFormatError naming ``named_by`` (the file that named it) or the path itself.

    The returned path is the unresolved ``root / name``, so messages keep the name the user
    knows. A path that does not exist is returned as is (callers report it as missing)."""
    path = root / name
    blame = path if named_by is None else named_by
    if "\0" in name:
        raise ModelFormatError(blame, f"{quote(name)} contains a NUL character")
    try:
        if not (path.exists() or path.is_symlink()):
            return path
        target = path.resolve()
    except RuntimeError:  # a symlink loop (Python < 3.13)
        raise ModelFormatError(blame, f"{quote(name)} is a symlink loop") from None
    except OSError as e:  # name too long, permission denied on a parent, ...
        raise ModelFormatError(blame, f"{quote(name)} cannot be looked up: {e.strerror}") from None
    if any(target == r or r in target.parents for r in _allowed_roots(root)):
        return path
    raise ModelFormatError(
        blame, f"{quote(name)} resolves to a path outside the checkpoint directory {root}; "
               "refusing to open it (a symlink or '..' leaving the directory)")


def confine_existing(root: Path, names: tuple[str, ...] | list[str]) -> None:
    """Check every one of ``names`` that exists in ``root`` with :func:`confine`."""
    for name in names:
        confine(root, name)
