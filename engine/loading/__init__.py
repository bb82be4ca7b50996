"""Open a model from a path: a Hugging Face checkpoint directory or a GGUF file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import ModelFormatError
from engine.loading.source import TensorSource


@dataclass
class ModelFiles:
    config: ModelConfig
    source: TensorSource
    path: Path

    def tokenizer(self):
        from engine.tokenizer import Tokenizer

        if self.path.suffix == ".gguf":
            return Tokenizer.from_gguf(self.path)
        return Tokenizer.from_hf_dir(self.path)


def open_model_files(path: str | Path, validate: bool = True) -> ModelFiles:
    """Detect the format, parse headers and validate every tensor's shape against the config.
    Reads no tensor data."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from engine.loading.gguf import GGUFSource

        source: TensorSource = GGUFSource(path)
    elif path.is_dir():
        from engine.loading.hf import HFSource

        source = HFSource(path)
    elif not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    else:
        raise ModelFormatError(path, "expected a Hugging Face checkpoint directory or a .gguf file")
    config = source.config  # type: ignore[attr-defined]
    if validate:
        from engine.loading.validate import check_source

        check_source(config, source)
    return ModelFiles(config, source, path)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, dense: str = "fp32",
               head: str | None = None):
    """(model, tokenizer, config) with every expert resident; the simplest way in. ``dense``:
    format of the dense linears (fp32 as loaded, bf16, int8 or auto: engine.quant.linear); ``head``:
    the LM head's (None: as ``dense``; int4 too)."""
    from engine.models.load import build_model
    from engine.quant.linear import quantize_dense

    files = open_model_files(path)
    model = quantize_dense(build_model(files.config, files.source, dtype=dtype), dense, head=head)
    return model, files.tokenizer(), files.config
