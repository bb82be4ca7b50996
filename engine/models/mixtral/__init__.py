"""Mixtral's home: the shared decoder with every layer sparse; spec and config fields."""
