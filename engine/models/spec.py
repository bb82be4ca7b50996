"""What an architecture's home (engine.models.<arch>) declares: its key, the names it goes by
in HF and GGUF files, how its HF tensor names map to canonical ones, and the hooks through
which it reads its config fields, lists its tensors and builds its model.

The registry (engine.models.registry) reads the name fields: they are the only tables of HF
architecture names, HF model types and GGUF architecture names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable


@lru_cache(maxsize=None)
def _compiled(renames: tuple[tuple[str, str], ...]) -> tuple[tuple[re.Pattern, str], ...]:
    return tuple((re.compile(p), r) for p, r in renames)


def canonical_name(renames: tuple[tuple[str, str], ...], hf_name: str) -> str:
    """``hf_name`` after the first of ``renames`` (pattern, replacement) that matches it."""
    for pattern, repl in _compiled(renames):
        new, n = pattern.subn(repl, hf_name)
        if n:
            return new
    return hf_name


@dataclass(frozen=True)
class ArchSpec:
    key: str
    # HF config.json "architectures" entries of this architecture
    hf_architectures: tuple[str, ...]
    # HF "model_type" values (read when "architectures" is absent); () means (key,)
    hf_model_types: tuple[str, ...] = ()
    # (pattern, replacement) applied in order to HF tensor names; the first match wins.
    hf_renames: tuple[tuple[str, str], ...] = ()
    # GGUF: architecture string in ``general.architecture``; gguf_accepts(metadata) -> bool
    # tells apart architectures that share one (llama.cpp writes Mixtral as "llama" with
    # experts): an accepting spec with a test wins over the one without.
    gguf_arch: str | None = None
    gguf_accepts: Callable[[Any], bool] | None = None
    # llama.cpp's converter permuted q/k rows into interleaved-rope order (its "llama" arch):
    # engine.loading.gguf permutes them back
    gguf_qk_permuted: bool = False
    # Config reading by the generic parsers (engine.configio): hf_fields(raw, integer, source)
    # -> ModelConfig fields overriding the shared decoder's defaults (routed experts, qk norm,
    # ...); gguf_fields(get, fields) -> the generic GGUF fields adjusted.
    hf_fields: Callable[..., dict[str, Any]] | None = None
    gguf_fields: Callable[..., dict[str, Any]] | None = None
    # Architectures whose layers differ from the shared decoder (engine.models.base) declare:
    # config_from_hf(raw config.json dict, source) -> ModelConfig (instead of the generic parser),
    # params_from_dict(dict) -> the ModelConfig.arch_params object (manifest round trip),
    # model_class() -> the CausalLM subclass to build (late import: model files import layers),
    # expected_tensors(config) -> (canonical name, shape) of every tensor, in layer order
    # (engine.loading.validate; None: the shared decoder's list),
    # hf_split(stored name, shape, dtype, stored_get) -> [(canonical, shape, dtype, load)] for a
    # stored tensor that is not one canonical tensor as is (fused/interleaved experts, MXFP4
    # blocks), ``load()`` reading it lazily; None: the generic handling.
    config_from_hf: Callable[..., Any] | None = None
    params_from_dict: Callable[[Any], Any] | None = None
    model_class: Callable[[], type] | None = None
    expected_tensors: Callable[[Any], Any] | None = None
    hf_split: Callable[..., Any] | None = None
    # GGUF: config_from_gguf(metadata, source) -> ModelConfig; gguf_split(gguf name, shape,
    # config) -> [(canonical, shape, expert index or None)] for names the generic map lacks.
    config_from_gguf: Callable[..., Any] | None = None
    gguf_split: Callable[..., Any] | None = None

    @property
    def model_types(self) -> tuple[str, ...]:
        return self.hf_model_types or (self.key,)

    def canonical_name(self, hf_name: str) -> str:
        """Map a tensor name as written by transformers to moestream's canonical name."""
        return canonical_name(self.hf_renames, hf_name)
