"""Qwen3-MoE's home: the shared decoder with q/k norms; spec and config fields."""
