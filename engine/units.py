"""Byte sizes as users write them: 2GiB, 512MiB, 1.5GB, 4096, or a percentage of a total."""

from __future__ import annotations

import re

from engine.errors import ConfigError

# KB/MB/GB are decimal, KiB/MiB/GiB binary; a bare K/M/G/T is binary, as in memory flags (-Xmx2g).
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*|%)\s*$")


def parse_bytes(text: str | int, *, total: int | None = None, name: str = "size") -> int:
    """'2GiB' -> 2147483648. 'N%' needs ``total`` (e.g. the store's expert bytes)."""
    if isinstance(text, bool):
        raise ConfigError(f"{name}={text!r} is not a number of bytes")
    if isinstance(text, float):
        if not text >= 0:
            raise ConfigError(f"{name}={text!r} is invalid; give bytes >= 0")
        return int(text)
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{name} must be >= 0 bytes, got {text}")
        return text
    if not isinstance(text, str):
        raise ConfigError(f"{name}={text!r} must be an int or a string like '2GiB'")
    m = _RE.match(text)
    if not m:
        raise ConfigError(f"{name}={text!r} is not a size; write e.g. 4096, 512MiB, 2GiB, 1.5GB or 25%")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if total is None:
            raise ConfigError(f"{name}={text!r}: a percentage needs a total to be a share of")
        return int(total * value / 100)
    if unit not in _UNITS:
        raise ConfigError(f"{name}={text!r}: unknown unit {m.group(2)!r}; use B, KiB, MiB, GiB, TiB, "
                          f"KB, MB, GB, TB (or K/M/G/T = KiB/MiB/GiB/TiB)")
    return int(value * _UNITS[unit])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"
