"""Decode-sized steps run with MOESTREAM_DECODE_THREADS intra-op threads, larger ones with the
process setting, and the setting is restored afterwards."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.executor import executor_for
from engine.options import RuntimeOptions, configure
from engine.threads import SMALL_STEP_TOKENS, step_threads


@pytest.fixture
def two_threads():
    prev, opts = torch.get_num_threads(), configure()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(prev)
    configure(opts)


def test_small_steps_use_decode_threads_and_restore(two_threads):
    cpu = torch.device("cpu")
    with step_threads(1, cpu):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with step_threads(SMALL_STEP_TOKENS + 1, cpu):
        assert torch.get_num_threads() == 2
    configure(decode_threads=2)
    with step_threads(1, cpu):
        assert torch.get_num_threads() == 2
    configure(decode_threads=5)  # never more than the process allows
    with step_threads(1, cpu):
        assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError):
        with step_threads(1, torch.device("cpu")):
            raise RuntimeError("step failed")
    assert torch.get_num_threads() == 2


def test_bad_setting_is_a_clear_error():
    for bad in ("0", "two"):
        with pytest.raises(ConfigError, match="MOESTREAM_DECODE_THREADS"):
            RuntimeOptions.from_env({"MOESTREAM_DECODE_THREADS": bad})
    with pytest.raises(ConfigError, match="MOESTREAM_INT8_ACTIVATIONS"):
        RuntimeOptions.from_env({"MOESTREAM_INT8_ACTIVATIONS": "yes"})
    with pytest.raises(ConfigError, match="decode_threads"):
        configure(decode_threads=0)
    assert RuntimeOptions.from_env({"MOESTREAM_FUSED_STEP": "0"}).fused_step is False
    assert RuntimeOptions.from_env({"MOESTREAM_AMX": "0"}).amx is False
    assert RuntimeOptions.from_env({}).amx is True
    assert RuntimeOptions.from_env({"MOESTREAM_STREAM_NTA": "0"}).stream_nta is False
    assert RuntimeOptions.from_env({}).stream_nta is True
    with pytest.raises(ConfigError, match="MOESTREAM_STREAM_NTA"):
        RuntimeOptions.from_env({"MOESTREAM_STREAM_NTA": "yes"})
    with pytest.raises(ConfigError, match="MOESTREAM_AMX"):
        RuntimeOptions.from_env({"MOESTREAM_AMX": "off"})


def test_model_forward_applies_it(two_threads):
    from engine.config import ModelConfig
    from engine.kv.base import BatchLayout, ContiguousKVCache
    from engine.models.base import CausalLM

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128)
    model = CausalLM(cfg)
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(torch.get_num_threads()))
    kv = ContiguousKVCache(1, 1, 16)
    executor_for(model)(torch.arange(20), BatchLayout.single(0, 20, 0), kv)
    executor_for(model)(torch.tensor([3]), BatchLayout.single(0, 1, 20), kv)
    assert seen == [2, 1] and torch.get_num_threads() == 2
