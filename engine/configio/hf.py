"""ModelConfig from a Hugging Face config.json: the architecture from ``architectures`` (or
``model_type``) through the registry, the fields every decoder shares here, and the
architecture's own fields from its home (ArchSpec.hf_fields, or ArchSpec.config_from_hf for
the architectures that parse the whole file themselves)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from engine.config import ModelConfig
from engine.configio.fields import bad_value, kind, read_hf_config_json
from engine.configio.hf_decoder import decoder_config
from engine.errors import ConfigError, ModelFormatError, UnsupportedArchitectureError
from engine.models import registry


def config_from_hf_dir(path: str | Path) -> ModelConfig:
    return config_from_hf_dir_raw(path)[0]


def config_from_hf_dir_raw(path: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """``(config, the parsed config.json)`` of a checkpoint directory; config.json must
    resolve inside the directory (engine.loading.paths)."""
    from engine.loading.paths import confine  # late: engine.loading's package imports this module

    cfg_path = confine(Path(path), "config.json")
    raw = read_hf_config_json(cfg_path)
    try:
        return config_from_hf_dict(raw, source=cfg_path), raw
    except ConfigError as e:  # a value out of range: name the file it came from
        raise ModelFormatError(cfg_path, str(e)) from None


def hf_arch(raw: Mapping[str, Any], source: object = "config.json") -> str:
    """Our architecture key of a config.json: the first ``architectures`` entry the registry
    knows, else (no ``architectures``) its ``model_type``."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ModelFormatError(source, f"architectures must be a list of strings, got {kind(archs)}")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelFormatError(source, f"model_type must be a string, got {kind(model_type)}")
    names = registry.hf_architectures()
    arch = next((names[a] for a in archs if a in names), None)
    if arch is None and not archs:
        arch = registry.hf_model_types().get(model_type)  # type: ignore[arg-type]
    if arch is None:
        raise UnsupportedArchitectureError(archs[0] if archs else model_type, list(names))
    return arch


def config_from_hf_dict(raw: Mapping[str, Any], source: object = "config.json") -> ModelConfig:
    arch = hf_arch(raw, source)
    spec = registry.get_spec(arch)
    if spec.config_from_hf is None:
        return decoder_config(arch, raw, source, spec.hf_fields)
    try:  # architectures with their own layers parse their fields
        return spec.config_from_hf(raw, source)
    except (TypeError, ValueError, ArithmeticError) as e:
        if isinstance(e, (ConfigError, ModelFormatError, UnsupportedArchitectureError)):
            raise
        raise ModelFormatError(source, bad_value(e)) from None
