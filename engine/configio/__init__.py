"""Reading a ModelConfig from what checkpoints carry: a Hugging Face config.json (``hf``), GGUF
metadata (``gguf``), the store manifest's plain dict (``plain``); ``fields`` reads single values
with typed errors. The architecture-specific parts live in each architecture's home
(engine.models.<arch>), found through engine.models.registry."""
