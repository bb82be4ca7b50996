"""RecurrentState and HybridKVCache: slots, positions, snapshots, budgets, metrics."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.configio.hf import config_from_hf_dict
from engine.errors import CapacityError, ConfigError
from engine.kv.base import BatchLayout
from engine.kv.paged import PagedKVCache
from engine.kv.state import (HybridKVCache, RecurrentState, RecurrentStateError, kv_cache_from_budget,
                             recurrent_state_for, slot_bytes)

RAW = {"architectures": ["Qwen3NextForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 8, "vocab_size": 96,
       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
       "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
       "linear_value_head_dim": 8, "full_attention_interval": 4}


@pytest.fixture
def cfg() -> ModelConfig:
    return config_from_hf_dict(RAW)


def test_slot_bytes_are_conv_window_plus_matrices(cfg):
    # 6 DeltaNet layers x (conv (2*16 + 32) x 3 + 4 heads x 8 x 8) x 4 bytes
    assert slot_bytes(cfg) == 6 * (64 * 3 + 4 * 8 * 8) * 4


def test_begin_positions_and_refuses_a_wrong_one(cfg):
    st = RecurrentState(cfg, num_slots=2)
    st.begin(BatchLayout((5,), (3,), (0,)))
    conv, mat = st.layer_state(2, 5)
    conv.fill_(1.0)
    mat.fill_(2.0)
    st.advance(BatchLayout((5,), (3,), (0,)))
    st.begin(BatchLayout((5,), (1,), (3,)))  # where it stands: kept
    assert float(st.layer_state(2, 5)[1].sum()) == 2.0 * mat.numel()
    with pytest.raises(RecurrentStateError, match="stands at position 3"):
        st.begin(BatchLayout((5,), (1,), (2,)))
    st.begin(BatchLayout((5,), (4,), (0,)))  # a recompute from 0 zeroes the slot
    assert float(st.conv.abs().sum()) == 0.0 and float(st.matrix.abs().sum()) == 0.0


def test_snapshot_and_restore_roll_one_sequence_back(cfg):
    st = RecurrentState(cfg, num_slots=2)
    g = torch.Generator().manual_seed(0)
    for seq in (1, 2):
        st.begin(BatchLayout((seq,), (4,), (0,)))
        st.conv[:, st.slot[seq]] = torch.randn(st.conv[:, 0].shape, generator=g)
        st.matrix[:, st.slot[seq]] = torch.randn(st.matrix[:, 0].shape, generator=g)
        st.advance(BatchLayout((seq,), (4,), (0,)))
    snap = st.snapshot(1)
    other = st.snapshot(2)
    conv, mat = st.layer_state(0, 1)
    conv.add_(1.0)
    mat.mul_(3.0)
    st.advance(BatchLayout((1,), (2,), (4,)))  # e.g. two draft tokens absorbed
    assert st.tokens[1] == 6
    st.restore(1, snap)
    assert st.tokens[1] == 4
    torch.testing.assert_close(st.conv[:, st.slot[1]], snap.conv, rtol=0, atol=0)
    torch.testing.assert_close(st.matrix[:, st.slot[1]], snap.matrix, rtol=0, atol=0)
    torch.testing.assert_close(st.matrix[:, st.slot[2]], other.matrix, rtol=0, atol=0)  # untouched
    st.begin(BatchLayout((1,), (1,), (4,)))  # and the forward continues from the restored point
    snap.matrix.zero_()  # a snapshot is a copy, not a view
    assert float(st.matrix[:, st.slot[1]].abs().sum()) > 0
    with pytest.raises(RecurrentStateError):
        st.snapshot(9)


def test_fixed_slots_run_out_and_come_back(cfg):
    st = RecurrentState(cfg, num_slots=2)
    st.acquire(1)
    st.acquire(2)
    assert not st.can_hold(3) and st.can_hold(1)
    with pytest.raises(CapacityError):
        st.acquire(3)
    st.free(1)
    assert st.acquire(3) == 0 and st.num_used == 2


def test_growable_state_keeps_what_it_holds(cfg):
    st = RecurrentState(cfg)
    for seq in range(5):
        st.acquire(seq)
        st.layer_state(1, seq)[1].fill_(float(seq))
    assert st.capacity >= 5
    assert [float(st.layer_state(1, s)[1][0, 0, 0]) for s in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_hybrid_cache_budget_slots_blocks_and_metrics(cfg):
    kv = HybridKVCache.from_budget(cfg, 1 << 20, block_size=4, dtype=torch.float32, max_seqs=3,
                                   prefix_cache=False)
    assert kv.state.capacity == 3
    per_block = HybridKVCache.block_bytes(cfg, 4, torch.float32)
    assert per_block == 2 * 2 * 4 * 2 * 16 * 4  # only the 2 attention layers hold KV
    assert kv.num_blocks == ((1 << 20) - 3 * slot_bytes(cfg)) // per_block
    # prefix caching: snapshots get what the slots leave of half the budget, at most a quarter
    on = HybridKVCache.from_budget(cfg, 1 << 20, block_size=4, dtype=torch.float32, max_seqs=3)
    snaps = (1 << 18) // slot_bytes(cfg)
    assert (on.state.capacity, on.snapshots.capacity) == (3, snaps)
    assert on.num_blocks == ((1 << 20) - (3 + snaps) * slot_bytes(cfg)) // per_block
    assert on.metrics().bytes_total == on.num_blocks * per_block + (3 + snaps) * slot_bytes(cfg)
    kv.allocate(7, 10)
    m = kv.metrics()
    assert (m.blocks_used, m.state_slots_used, m.num_sequences) == (3, 1, 1)
    assert m.bytes_used == 3 * per_block + slot_bytes(cfg)
    for s in (8, 9):
        kv.allocate(s, 1)
    assert not kv.can_allocate(10, 1) and kv.can_allocate(7, 12)  # no slot for a 4th sequence
    kv.free(7)
    assert kv.can_allocate(10, 1)
    for s in (8, 9):
        kv.free(s)
    m = kv.metrics()
    assert (m.blocks_used, m.state_slots_used, m.bytes_used) == (0, 0, 0)
    with pytest.raises(ConfigError, match="no recurrent-state slot"):
        HybridKVCache.from_budget(cfg, slot_bytes(cfg), dtype=torch.float32)


def test_kv_cache_from_budget_and_side_state(cfg):
    assert isinstance(kv_cache_from_budget(cfg, 1 << 20), HybridKVCache)
    plain = config_from_hf_dict({**RAW, "architectures": ["Qwen3MoeForCausalLM"]})
    assert isinstance(kv_cache_from_budget(plain, 1 << 20), PagedKVCache)
    with pytest.raises(ConfigError, match="HybridKVCache"):
        recurrent_state_for(PagedKVCache(8, 2, 16, 4), cfg)
