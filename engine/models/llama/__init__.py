"""Llama's home: the shared decoder (engine.models.base) with its defaults; only a spec."""
