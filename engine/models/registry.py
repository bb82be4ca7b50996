"""Registry of architectures, keyed by our architecture key (see engine.config.HF_ARCHITECTURES)."""

from __future__ import annotations

from engine.errors import UnsupportedArchitectureError
from engine.models import llama, mixtral, qwen2_moe, qwen3_moe
from engine.models.spec import ArchSpec

ARCHITECTURES: dict[str, ArchSpec] = {
    m.SPEC.key: m.SPEC for m in (llama, mixtral, qwen2_moe, qwen3_moe)
}


def get_spec(arch: str) -> ArchSpec:
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        raise UnsupportedArchitectureError(arch, list(ARCHITECTURES)) from None
