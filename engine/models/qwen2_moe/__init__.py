"""Qwen2-MoE's home: the shared decoder with qkv bias and a gated shared expert; spec and
config fields."""
