"""What the commands check before they start work, and how a failure reaches the user.

A typed moestream error, or an OS error about a file (full disk, read-only file system, a path
under a regular file), becomes one line ``error: ...`` on stderr and exit status 2, never a
traceback. Inputs that would fail late are checked first: an output path that cannot be
written, a prompt that is not UTF-8, a budget larger than the machine (refused before anything
is allocated), naming the option and what was asked.
"""

from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NoReturn

import click

from engine.errors import ConfigError, MoestreamError


def fail(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


def describe(exc: BaseException) -> str:
    """One line for the user: the file an OS error is about, and the problem."""
    if isinstance(exc, OSError) and not isinstance(exc, MoestreamError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return f"{where}{exc.strerror}"
    return str(exc) or type(exc).__name__


@contextmanager
def one_line_errors() -> Iterator[None]:
    try:
        yield
    except (MoestreamError, OSError) as e:  # expected failures: one clear line, exit 2
        fail(describe(e))


def typed_errors(fn: Callable) -> Callable:
    """Decorator form of :func:`one_line_errors` for a command run on its own."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with one_line_errors():
            return fn(*args, **kwargs)

    return wrapper


# ---- inputs ------------------------------------------------------------------------------------


def check_utf8(text: str | None, what: str) -> str | None:
    """``text`` as given on the command line must be valid UTF-8 (the shell hands undecodable
    bytes over as lone surrogates, which no tokenizer or wire format takes)."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = text[e.start].encode("utf-8", "surrogateescape")
        raise ConfigError(f"{what} is not valid UTF-8: byte 0x{raw.hex()} at character "
                          f"{e.start}") from None
    return text


def check_output(path: str | os.PathLike, option: str, *, directory: bool = False) -> Path:
    """Refuse, before any work, an output path the command could not create: one under a
    regular file, a directory where a file goes (or the reverse), or one on a read-only file
    system or without write permission."""
    p = Path(path)
    if p.exists() and p.is_dir() != directory:
        raise ConfigError(f"{option} {path}: is {'not ' if directory else ''}a directory")
    parent = p if directory else p.parent
    existing = next(a for a in (parent, *parent.parents) if a.exists() or a == a.parent)
    if not existing.is_dir():
        raise ConfigError(f"{option} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: {existing} is not writable (read-only file system "
                          f"or no permission)")
    return p


@contextmanager
def writing(path: str | os.PathLike, option: str) -> Iterator[None]:
    """An OS error while the command writes ``path`` (a full disk, say) names the option and
    the path: the error of a write() call names no file."""
    try:
        yield
    except OSError as e:
        raise ConfigError(f"{option} {path}: {describe(e)}") from None


# ---- budgets -----------------------------------------------------------------------------------


def host_memory() -> int:
    """Bytes of RAM this process may use: physical memory, or the cgroup limit when lower."""
    from engine.experts.device_budget import host_memory as physical

    return physical()


def device_memory(device: str) -> tuple[int, str]:
    """(bytes, what they are) of the memory the device tier lives in."""
    import torch

    if torch.device(device).type == "cuda":
        idx = torch.device(device).index or 0
        return torch.cuda.get_device_properties(idx).total_memory, f"GPU {idx} memory"
    return host_memory(), "RAM (the device tier is host memory on the CPU)"


def check_budget(option: str, given: object, asked: int, available: int, what: str) -> None:
    """Refuse a budget larger than the memory it must fit in, before anything is allocated."""
    from engine.units import format_bytes

    if asked > available:
        shown = f"{given} = {format_bytes(asked)}" if str(given) != str(asked) else format_bytes(asked)
        raise ConfigError(f"{option} {shown} is more than this machine's {what}: "
                          f"{format_bytes(available)}")
