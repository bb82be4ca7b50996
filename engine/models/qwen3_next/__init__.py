"""Qwen3-Next's home: spec, config fields (config.py), the hybrid torch modules (model.py), the
tensors it implies (tensors.py), the GGUF reader (gguf.py) and its native step (step.py)."""
