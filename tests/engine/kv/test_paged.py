"""Block pool bookkeeping (exact ids and refcounts) and the paged KV cache against the
contiguous reference: bit-identical K/V and model logits at fp32/bf16, bounded FP8 error."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.errors import CapacityError, ConfigError
from engine.executor import executor_for
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.kv.paged import FP8, BlockPool, PagedKVCache
from engine.loading import open_model_files
from engine.models.load import build_model
from tests.engine.models.hf_tiny import make_checkpoint


# ---- block pool ------------------------------------------------------------------------------
def test_block_pool_fifo_ids_and_refcounts():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert (pool.num_used, pool.num_free) == (5, 1)
    pool.free([1, 0])
    assert pool.free_ids() == [5, 1, 0]  # freed blocks go to the tail, in the order given
    pool.incref([3])
    assert pool.refcounts == [0, 0, 1, 2, 1, 0]
    pool.free([3])
    assert pool.free_ids() == [5, 1, 0]  # still referenced once
    pool.free([3])
    assert pool.free_ids() == [5, 1, 0, 3]
    assert pool.allocate(2) == [5, 1]
    with pytest.raises(CapacityError, match="3 blocks requested, 2 of 6 free"):
        pool.allocate(3)
    assert pool.free_ids() == [0, 3]  # a failed allocate takes nothing
    with pytest.raises(AssertionError, match="double free"):
        pool.free([0])
    with pytest.raises(ConfigError):
        BlockPool(0)


def test_block_tables_and_can_allocate():
    kv = PagedKVCache(1, 1, 1, num_blocks=6, block_size=4, dtype=torch.float32)
    assert kv.allocate(7, 5) == [0, 1]
    assert kv.allocate(7, 8) == []  # 8 tokens still fit in two blocks
    assert kv.allocate(7, 9) == [2]
    assert kv.block_table(7) == [0, 1, 2]
    assert kv.can_allocate(8, 12) and not kv.can_allocate(8, 13)
    assert kv.can_allocate(7, 24) and not kv.can_allocate(7, 25)  # counts blocks it already has
    assert kv.allocate(8, 1) == [3]
    kv.free(7)
    assert kv.pool.free_ids() == [4, 5, 0, 1, 2]
    kv.free(7)  # freeing an unknown / already freed sequence is a no-op
    m = kv.metrics()
    assert (m.blocks_total, m.blocks_used, m.blocks_free, m.num_sequences) == (6, 1, 5, 1)
    assert m.utilisation == pytest.approx(1 / 6)
    assert m.bytes_total == 6 * 2 * 4 * 4 and m.bytes_used == 2 * 4 * 4


def test_native_view_tables_follow_every_change_of_the_block_tables():
    """The int32 block tables native_view hands the native step (kept per sequence and grown in
    place, not rebuilt from the lists each step) equal the lists after every kind of change:
    growth within and past the buffer's capacity, a sequence freed and started again, a table
    adopted from the prefix cache, batches of several sequences padded with zeros. A view handed
    out earlier keeps its ids."""
    import random

    rng = random.Random(3)
    kv = PagedKVCache(1, 1, 2, num_blocks=400, block_size=2, dtype=torch.float32, prefix_cache=True)
    ends = {0: 0, 1: 0, 2: 0}
    kept = []
    for step in range(300):
        s = rng.choice([0, 1, 2])
        op = rng.random()
        if op < 0.08 and ends[s]:
            kv.free(s)
            ends[s] = 0
            continue
        if op < 0.12 and ends[s] == 0 and kv.tables.get(s) is None:
            # a new table assigned whole (what adopt does): held blocks of no one
            kv.tables[s] = kv.pool.allocate(2)
            kv.lengths[s] = 4
            ends[s] = 4
        ends[s] += rng.choice([1, 1, 1, 5, 40])
        if not kv.can_allocate(s, ends[s]):
            kv.free(s)
            ends[s] = 0
            continue
        seqs = [q for q in (0, 1, 2) if ends[q]]
        rng.shuffle(seqs)
        seqs = seqs[:rng.choice([1, len(seqs)])]
        layout = BatchLayout(tuple(seqs), tuple(1 for _ in seqs), tuple(ends[q] - 1 for q in seqs))
        _, tables = kv.native_view(layout, torch.device("cpu"))
        width = max(len(kv.tables[q]) for q in seqs)
        want = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, q in enumerate(seqs):
            want[i, :len(kv.tables[q])] = torch.tensor(kv.tables[q], dtype=torch.int32)
        assert tables.dtype == torch.int32 and tables.is_contiguous()
        assert torch.equal(tables, want), (step, seqs)
        kept.append((tables, want))
    for tables, want in kept:
        assert torch.equal(tables, want)


def test_store_and_load_allocates_on_demand_and_raises_when_full():
    kv = PagedKVCache(2, 1, 2, num_blocks=2, block_size=2, dtype=torch.float32)
    k = torch.randn(3, 1, 2)
    keys, values = kv.store_and_load(0, 0, 0, k, -k)
    assert torch.equal(keys, k) and torch.equal(values, -k)
    assert kv.block_table(0) == [0, 1]
    with pytest.raises(CapacityError):
        kv.store_and_load(0, 1, 0, k, k)


def test_from_budget_sizes_blocks_and_names_the_numbers():
    cfg = ModelConfig(arch="qwen3_moe", vocab_size=96, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    per_block = cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 2  # bf16
    kv = PagedKVCache.from_budget(cfg, 10 * per_block + 5, block_size=16)
    assert kv.num_blocks == 10 and kv.metrics().bytes_total == 10 * per_block
    fp8 = PagedKVCache.from_budget(cfg, 10 * per_block, block_size=16, dtype=FP8)
    assert fp8.num_blocks == 10 * per_block // (per_block // 2 + cfg.num_layers * 2 * 4)
    with pytest.raises(ConfigError, match="holds no block"):
        PagedKVCache.from_budget(cfg, per_block - 1)
    with pytest.raises(ConfigError, match="not supported"):
        PagedKVCache(1, 1, 1, 4, dtype=torch.int8)


# ---- data path against the contiguous reference ------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_store_and_load_equals_contiguous(dtype):
    g = torch.Generator().manual_seed(0)
    ref = ContiguousKVCache(3, 2, 4, dtype=dtype)
    paged = PagedKVCache(3, 2, 4, num_blocks=32, block_size=4, dtype=dtype)
    lens = {0: 0, 1: 0, 2: 0}
    for n_by_seq in ({0: 7, 1: 1}, {2: 9}, {0: 1, 1: 5, 2: 1}, {0: 4, 1: 1, 2: 3}):
        for seq, n in n_by_seq.items():
            for layer in range(3):
                k = torch.randn(n, 2, 4, generator=g).to(dtype)
                v = torch.randn(n, 2, 4, generator=g).to(dtype)
                want = ref.store_and_load(layer, seq, lens[seq], k, v)
                got = paged.store_and_load(layer, seq, lens[seq], k, v)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            lens[seq] += n
    assert paged.metrics().tokens_stored == sum(lens.values())


def test_fp8_per_block_scale_requantizes_and_bounds_error():
    kv = PagedKVCache(1, 1, 4, num_blocks=5, block_size=4, dtype=FP8)
    small = torch.full((2, 1, 4), 0.01)
    kv.store_and_load(0, 0, 0, small, small)
    assert kv.scales[0, 0, 0].item() == pytest.approx(0.01 / 448)
    big = torch.tensor([[[1.0, -300.0, 2.0, 3.0]]])  # same block: its scale grows 30000x
    keys, _ = kv.store_and_load(0, 0, 2, big, big)
    assert kv.scales[0, 0, 0].item() == pytest.approx(300 / 448)
    assert keys[2].flatten().tolist() == pytest.approx(big.flatten().tolist(), rel=2 ** -4)
    # the small values were requantized to the new scale: now within e4m3's subnormal step
    assert (keys[:2] - 0.01).abs().max().item() <= 300 / 448 * 2 ** -10
    x = torch.randn(13, 1, 4, generator=torch.Generator().manual_seed(1))
    keys, _ = kv.store_and_load(0, 1, 0, x, x)
    for b in range(4):  # each block within e4m3's half-ulp of its own amax
        blk = x[4 * b:4 * b + 4]
        assert (keys[4 * b:4 * b + 4] - blk).abs().max() <= blk.abs().max() * 2 ** -4


def test_fp8_static_scale_saturates():
    kv = PagedKVCache(1, 1, 2, num_blocks=1, block_size=4, dtype=FP8, fp8_scale=0.5)
    keys, _ = kv.store_and_load(0, 0, 0, torch.tensor([[[1.0, 1000.0]]]), torch.zeros(1, 1, 2))
    assert keys.flatten().tolist() == [1.0, 224.0]  # 448 * 0.5
    with pytest.raises(ConfigError):
        PagedKVCache(1, 1, 2, num_blocks=1, dtype=FP8, fp8_scale=-1.0)


# ---- model logits ----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, path, seed=3)
    return open_model_files(path)


# (seq, n_new) per forward: chunked prefills, a batch that mixes prefill chunks with decodes
SCHEDULE = [[(0, 9), (1, 3)], [(0, 1), (1, 6), (2, 5)], [(0, 1), (1, 1), (2, 1)],
            [(2, 12), (0, 1)], [(0, 1), (1, 1), (2, 1)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_logits_paged_equal_contiguous(tiny, dtype):
    cfg = tiny.config
    model = build_model(cfg, tiny.source, dtype=dtype)
    tokens = torch.randint(3, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(2))
    caches = [ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=dtype),
              PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=16,
                           block_size=4, dtype=dtype)]
    outs = []
    for kv in caches:
        pos, logits = [0, 0, 0], []
        for step in SCHEDULE:
            flat = torch.cat([tokens[s, pos[s]:pos[s] + n] for s, n in step])
            layout = BatchLayout(tuple(s for s, _ in step), tuple(n for _, n in step),
                                 tuple(pos[s] for s, _ in step))
            logits.append(executor_for(model)(flat, layout, kv, all_logits=True))
            for s, n in step:
                pos[s] += n
        outs.append(torch.cat(logits))
    assert torch.equal(outs[0], outs[1])
    assert caches[1].block_table(2) == [6, 7, 8, 9, 10]  # 5 + 1 tokens, then 12 more + 1
