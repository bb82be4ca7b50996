"""What an architecture file declares: its key, how its HF tensor names map to canonical ones."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ArchSpec:
    key: str
    hf_architectures: tuple[str, ...]
    # (pattern, replacement) applied in order to HF tensor names; the first match wins.
    hf_renames: tuple[tuple[str, str], ...] = ()
    # GGUF: architecture string in ``general.architecture``.
    gguf_arch: str | None = None
    _compiled: list = field(default_factory=list, compare=False, repr=False)

    def canonical_name(self, hf_name: str) -> str:
        """Map a tensor name as written by transformers to moestream's canonical name."""
        if not self._compiled:
            self._compiled.extend((re.compile(p), r) for p, r in self.hf_renames)
        for pattern, repl in self._compiled:
            new, n = pattern.subn(repl, hf_name)
            if n:
                return new
        return hf_name
