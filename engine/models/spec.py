"""What an architecture file declares: its key, how its HF tensor names map to canonical ones."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class ArchSpec:
    key: str
    hf_architectures: tuple[str, ...]
    # (pattern, replacement) applied in order to HF tensor names; the first match wins.
    hf_renames: tuple[tuple[str, str], ...] = ()
    # GGUF: architecture string in ``general.architecture``.
    gguf_arch: str | None = None
    # Architectures whose layers differ from the shared decoder (engine.models.base) declare:
    # config_from_hf(raw config.json dict, source) -> ModelConfig (instead of the generic parser),
    # params_from_dict(dict) -> the ModelConfig.arch_params object (manifest round trip),
    # model_class() -> the CausalLM subclass to build (late import: model files import layers),
    # hf_split(stored name, shape, dtype, stored_get) -> [(canonical, shape, dtype, load)] for a
    # stored tensor that is not one canonical tensor as is (fused/interleaved experts, MXFP4
    # blocks), ``load()`` reading it lazily; None: the generic handling.
    config_from_hf: Callable[..., Any] | None = None
    params_from_dict: Callable[[Any], Any] | None = None
    model_class: Callable[[], type] | None = None
    hf_split: Callable[..., Any] | None = None
    # GGUF: config_from_gguf(metadata, source) -> ModelConfig; gguf_split(gguf name, shape,
    # config) -> [(canonical, shape, expert index or None)] for names the generic map lacks.
    config_from_gguf: Callable[..., Any] | None = None
    gguf_split: Callable[..., Any] | None = None
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
