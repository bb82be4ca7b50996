"""Small text helpers the streaming parsers share."""

from __future__ import annotations

from typing import Iterable


def held_prefix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker: what a
    streaming parser holds back, since the next piece may complete the marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def find_first(text: str, markers: Iterable[str]) -> tuple[int, str | None]:
    """(position, marker) of the earliest marker in ``text``; (-1, None) when none occurs."""
    at, hit = -1, None
    for m in markers:
        i = text.find(m)
        if i >= 0 and (at < 0 or i < at):
            at, hit = i, m
    return at, hit
