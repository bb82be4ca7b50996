"""RoPE scaling: GGUF-style per-frequency factors reproduce HF's llama3 scaling exactly."""

from __future__ import annotations

import torch

from engine.config import RopeConfig
from engine.layers.rope import inv_frequencies


def test_freq_factors_reproduce_llama3_scaling():
    head_dim = 64
    llama3 = RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=8192)
    plain = RopeConfig(theta=500000.0)
    want, _ = inv_frequencies(llama3, head_dim)
    base, _ = inv_frequencies(plain, head_dim)
    factors = tuple((base / want).tolist())  # what llama.cpp writes as rope_freqs.weight
    assert max(factors) > 7.9 and min(factors) == 1.0  # long wavelengths scaled, short kept
    got, _ = inv_frequencies(RopeConfig(theta=500000.0, freq_factors=factors), head_dim)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_wrong_number_of_factors_is_a_config_error():
    import pytest

    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="freq_factors has 3 entries"):
        inv_frequencies(RopeConfig(freq_factors=(1.0, 2.0, 3.0)), 64)
