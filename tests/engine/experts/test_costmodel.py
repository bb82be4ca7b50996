"""The cost model's arithmetic on hand-made inputs, the shapes' byte counts against the model
config's and the quantizer's own, the memory split, and the device budget ledger."""

from __future__ import annotations

import pytest
import torch

from engine.costmodel import (SHAPES, ModelShape, Target, int4_expert_bytes, layer_time, memory_split,
                              predict, token_time)
from engine.errors import ConfigError, DeviceBudgetError
from engine.experts.device_budget import DeviceBudget

T = Target("hand", device_bw=1e9, link_bw=1e9, vram=10**10, layer_overhead_s=0.5)


def target(**kw) -> Target:
    base = dict(name="hand", device_bw=1e9, link_bw=1e9, vram=10**10, layer_overhead_s=0.5)
    base.update(kw)
    return Target(**base)


def test_layer_time_by_hand():
    # compute = 1e9 / 1e9 + 0.5 = 1.5 s; transfer = 2e9 / 1e9 = 2 s
    assert layer_time(1e9, 2e9, target(overlap=0.0)) == pytest.approx(3.5)  # serial
    assert layer_time(1e9, 2e9, target(overlap=1.0)) == pytest.approx(2.0)  # max(1.5, 2)
    assert layer_time(1e9, 2e9, target(overlap=0.5)) == pytest.approx(2.5)  # max(1.5, 1) + 1
    assert layer_time(1e9, 0.5e9, target(overlap=1.0)) == pytest.approx(1.5)  # hidden entirely
    # 4 missed experts at 0.25 s each beside their bytes
    assert layer_time(1e9, 2e9, target(miss_overhead_s=0.25), 4) == pytest.approx(1.5 + 2 + 1)


def test_token_time_sums_layers_and_head():
    t = target(overlap=0.0)
    layers = [(1e9, 0.0), (2e9, 1e9, 2)]
    assert token_time(layers, 3e9, t) == pytest.approx(1.5 + (2.5 + 1) + 3)


def test_expert_bytes_match_the_quantizer():
    from engine.quant.formats import QuantFormat
    from engine.quant.expert_blob import expert_bytes_for

    for hidden, width in ((2048, 768), (512, 256), (128, 64), (1024, 512)):
        assert int4_expert_bytes(hidden, width) == expert_bytes_for(width, hidden, QuantFormat("int4", 64))
    full = SHAPES["full"]
    assert full.expert_bytes == 2_764_800  # issue #26: ~2.76 MB per expert at 4.5 bits
    assert full.num_experts_total * full.expert_bytes == pytest.approx(68e9, rel=0.01)  # ~68 GB
    assert full.slot_bytes % 4096 == 0 and full.slot_bytes >= full.expert_bytes


def test_runnable_shapes_count_like_the_model_config():
    from engine.experts.synthetic_store import model_config

    for name in ("tiny", "small", "full-runnable"):
        shape = SHAPES[name]
        counts = model_config(shape).parameter_counts()
        assert counts["dense"] == shape.dense_params, name
        assert counts["routed_total"] == shape.routed_params, name


def test_qwen3_next_mix_by_hand():
    s = ModelShape("mix", layers=4, hidden=8, experts=4, expert_width=2, top_k=1, shared_width=0, vocab=10,
                   heads=2, kv_heads=1, head_dim=4, attn_gate=True, linear_key_heads=1, linear_value_heads=2,
                   linear_head_dim=4, conv_kernel=2, full_attention_every=4)
    assert [s.is_linear(l) for l in range(4)] == [True, True, True, False]
    # attention: q (gated: 2*2*4=16) + k, v (2*1*4=8) from 8 wide, o: 8 -> 8
    assert s.attention_params == 8 * (16 + 8) + 8 * 8
    # delta net: kd 4, vd 8: in 8*(8 + 16) + beta/alpha 8*2*2 + conv (8+8)*2 + out 8*8
    assert s.linear_params == 8 * 24 + 32 + 32 + 64
    assert s.attention_layers == 1
    assert s.kv_bytes_per_token(2) == 1 * 2 * 1 * 4 * 2
    assert s.state_bytes() == 4 * 3 * ((8 + 8) * 1 + 2 * 16)


def test_memory_split_and_budget_error():
    s = ModelShape("hand", layers=2, hidden=128, experts=8, expert_width=64, top_k=2, shared_width=0, vocab=100,
                   heads=2, kv_heads=1, head_dim=64)
    split = memory_split(s, 10 * 2**20, dense_format="bf16", context=100, workspace=2**20)
    assert split.dense == int(s.dense_params * 2)
    assert split.kv == 100 * s.kv_bytes_per_token()
    free = 10 * 2**20 - split.dense - split.kv - split.workspace
    assert split.num_slots == free // s.slot_bytes
    assert split.slots == split.num_slots * s.slot_bytes
    with pytest.raises(DeviceBudgetError, match="fewer than top_k=2"):
        memory_split(s, split.dense + split.kv + 2**20 + s.slot_bytes, dense_format="bf16", context=100,
                     workspace=2**20)
    with pytest.raises(ConfigError):
        memory_split(s, 2**30, dense_format="fp8")


def test_predict_by_hand():
    s = ModelShape("hand", layers=2, hidden=64, experts=4, expert_width=64, top_k=2, shared_width=0, vocab=16,
                   heads=1, kv_heads=1, head_dim=64)
    t = target(device_bw=1e6, link_bw=1e5, layer_overhead_s=0.01, overlap=0.0)
    p = predict(s, t, 0.75, dense_format="bf16")
    dense_layer = s.layer_dense_params(0) * 2.0
    routed = 2 * s.expert_bytes
    missed = 0.25 * routed
    want = 2 * (dense_layer / 1e6 + routed / 1e6 + 0.01 + missed / 1e5) + 16 * 64 * 2 / 1e6
    assert p.token_s == pytest.approx(want)
    assert p.tok_s == pytest.approx(1 / want)
    assert p.missed_bytes == pytest.approx(2 * missed)
    assert predict(s, t, 1.0).transfer_s == 0
    assert predict(s, t, 0.0).tok_s < predict(s, t, 0.5).tok_s < predict(s, t, 1.0).tok_s
    with pytest.raises(ConfigError):
        predict(s, t, 1.5)
    with pytest.raises(ConfigError):
        target(overlap=2.0)


def test_device_budget_ledger_refuses_past_the_cap():
    b = DeviceBudget(100, "cpu")
    b.charge("dense weights", 60)
    b.charge("KV cache", 30)
    with pytest.raises(DeviceBudgetError, match=r"expert slots: .*11 B.* does not fit .*100 B.*dense weights"):
        b.charge("expert slots", 11)
    assert b.used == 90 and "expert slots" not in b.charges  # nothing recorded
    b.charge("expert slots", 10)
    assert b.free == 0 and b.check_peak() == 100
    b.release("KV cache")
    assert b.used == 70
    with pytest.raises(ConfigError):
        DeviceBudget(0)
    with pytest.raises(ConfigError):
        b.charge("x", -1)


def test_device_budget_guard_types_the_allocator_error():
    b = DeviceBudget(2**20, "cpu")
    with pytest.raises(DeviceBudgetError, match="building: the device allocator refused"):
        with b.guard("building"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with b.guard("fine"):
        pass


def test_qwen4_exp_full_shape_counts():
    """The headline shape is qwen4_exp's published config (engine/models/qwen4_exp/published):
    36 DeltaNet + 12 QSA layers, 125B in all, ~6B active, its PLE table (51.2B) outside the
    device's bytes; the parts by hand, and the totals as `moestream info` counts them."""
    f = SHAPES["full"]
    assert (f.layers - f.attention_layers, f.attention_layers) == (36, 12)
    width = 4 * 2560
    assert f.hyper_params == width + 2 * 320 * width + 4 * width
    assert f.indexer_params == 17 * 128 * 2560 + 2 * 128
    assert f.ple_layer_params == width * 2560 + 2560 * 2560 + 3 * width + width * 4
    assert [l for l in range(48) if f.is_ple(l)] == [0]  # one PLE layer, a DeltaNet layer
    total = f.dense_params + f.routed_params
    active = f.dense_params - f.vocab * f.hidden + f.layers * f.top_k * 3 * f.hidden * f.expert_width
    assert total == pytest.approx(125e9, rel=0.01) and active == pytest.approx(6e9, rel=0.02)
    assert f.ple_params == 320_000_000 * 160 and f.ple_rows_per_token == 16
    runnable = SHAPES["full-runnable"]
    per_layer = lambda s: sum(s.layer_dense_params(l) for l in range(s.layers)) / s.layers  # noqa: E731
    assert per_layer(runnable) == pytest.approx(per_layer(f), rel=0.01)


def test_ple_reads_in_the_prediction():
    s = ModelShape("ple", layers=4, hidden=8, experts=4, expert_width=2, top_k=1, shared_width=0, vocab=10,
                   heads=2, kv_heads=1, head_dim=4, linear_key_heads=1, linear_value_heads=2, linear_head_dim=4,
                   full_attention_every=4, hc_count=2, hc_lowrank=2, ple_layers=2, ple_embed_dim=8, ple_heads=4,
                   ple_rows=100)
    t = target(overlap=0.0, page_read_s=0.5)
    base = predict(s, t, 1.0)
    assert base.ple_s == pytest.approx(8 * 0.5) and base.ple_bytes == 8 * 4096  # 2 layers x 4 rows, all read
    half = predict(s, t, 1.0, ple_hit_rate=0.5)
    assert half.ple_s == pytest.approx(2.0) and base.token_s - half.token_s == pytest.approx(2.0)
    assert predict(s, target(overlap=0.0), 1.0).ple_s == 0.0
    with pytest.raises(ConfigError, match="ple_hit_rate"):
        predict(s, t, 1.0, ple_hit_rate=1.5)


def test_full_shape_counts_like_the_published_config():
    """SHAPES["full"] and the engine's own parameter counts of the published config (the ones
    `moestream info` prints, equal to transformers') agree: routed and PLE exactly, dense to the
    QSA indexer's norms and the PLE tables' padding (< 0.01%)."""
    from engine.configio.fields import read_hf_config_json
    from engine.configio.hf import config_from_hf_dict
    from engine.costmodel import PUBLISHED_QWEN4_EXP

    counts = config_from_hf_dict(read_hf_config_json(PUBLISHED_QWEN4_EXP),
                                 source=PUBLISHED_QWEN4_EXP).parameter_counts()
    f = SHAPES["full"]
    assert counts["routed_total"] == f.routed_params
    assert counts["dense"] == pytest.approx(f.dense_params, rel=1e-4)
    assert counts["ple_total"] == pytest.approx(f.ple_params, rel=1e-4)
    assert counts["ple_active"] == f.ple_rows_per_token * f.ple_row_dim
