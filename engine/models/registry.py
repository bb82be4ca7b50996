"""Registry of architectures: our architecture key -> the ArchSpec its home declares
(engine.models.<arch>.spec). The specs' name fields are the one source of the HF architecture
names, HF model types and GGUF architecture names; the spec modules are light (model classes,
native steps and tensor splitters are imported when first used)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping

from engine.errors import UnsupportedArchitectureError
from engine.models.deepseek_v3 import spec as deepseek_v3
from engine.models.gpt_oss import spec as gpt_oss
from engine.models.llama import spec as llama
from engine.models.mixtral import spec as mixtral
from engine.models.qwen2_moe import spec as qwen2_moe
from engine.models.qwen3_5_moe import spec as qwen3_5_moe
from engine.models.qwen3_moe import spec as qwen3_moe
from engine.models.qwen3_next import spec as qwen3_next
from engine.models.qwen4_exp import spec as qwen4_exp
from engine.models.spec import ArchSpec

ARCHITECTURES: dict[str, ArchSpec] = {
    m.SPEC.key: m.SPEC
    for m in (llama, mixtral, qwen2_moe, qwen3_moe, qwen3_next, gpt_oss, deepseek_v3, qwen3_5_moe,
              qwen4_exp)
}


def get_spec(arch: str) -> ArchSpec:
    try:
        return ARCHITECTURES[arch]
    except (KeyError, TypeError):
        raise UnsupportedArchitectureError(arch, list(ARCHITECTURES)) from None


@lru_cache(maxsize=1)
def hf_architectures() -> dict[str, str]:
    """HF ``architectures`` entry -> our key."""
    return {name: s.key for s in ARCHITECTURES.values() for name in s.hf_architectures}


@lru_cache(maxsize=1)
def hf_model_types() -> dict[str, str]:
    """HF ``model_type`` -> our key (for a config.json without ``architectures``)."""
    return {t: s.key for s in ARCHITECTURES.values() for t in s.model_types}


def gguf_architectures() -> list[str]:
    """The GGUF ``general.architecture`` values we read, in registry order."""
    return list(dict.fromkeys(s.gguf_arch for s in ARCHITECTURES.values() if s.gguf_arch))


def spec_for_gguf(garch: Any, meta: Mapping[str, Any]) -> ArchSpec:
    """The spec of a GGUF file's ``general.architecture`` (UnsupportedArchitectureError if none
    reads it); among specs sharing it, one whose ``gguf_accepts`` accepts ``meta``, else the
    one without a test."""
    candidates = [s for s in ARCHITECTURES.values() if s.gguf_arch is not None and s.gguf_arch == garch]
    tested = [s for s in candidates if s.gguf_accepts is not None and s.gguf_accepts(meta)]
    plain = [s for s in candidates if s.gguf_accepts is None]
    if not (tested or plain):
        raise UnsupportedArchitectureError(garch, gguf_architectures())
    return (tested or plain)[0]
