"""The Triton paged decode-attention kernel against the eager layer's reference
(engine.layers.attention.attend on each sequence's gathered context), in Triton's interpreter on
CPU tensors (compiled on CUDA: tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from engine.layers import paged_attention_triton as PA
from engine.layers.attention import attend

pytestmark = pytest.mark.skipif(not PA.supports(torch.device("cpu")),
                                reason="Triton's interpreter is not available in this process")


def random_case(nh, nkv, d, bs, lens, dtype, seed, width=None, nb=None):
    """Caches [NB, BS, Nkv, D] of random values, each row's blocks scattered over the pool
    (a random permutation), tables padded to ``width`` with a block no row owns."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-c // bs) for c in lens]
    width = width or max(need)
    nb = nb or sum(need) + 3
    k_cache = torch.randn(nb, bs, nkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(nb, bs, nkv, d, generator=gen).to(dtype)
    perm = torch.randperm(nb, generator=gen).tolist()
    tables = torch.full((len(lens), width), perm[-1], dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    q = torch.randn(len(lens), nh, d, generator=gen)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def reference(q, k_cache, v_cache, tables, lens):
    out = []
    bs = k_cache.shape[1]
    for i, c in enumerate(lens.tolist()):
        blocks = tables[i, :-(-c // bs)].long()
        keys = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:c].to(q.dtype)
        values = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:c].to(q.dtype)
        out.append(attend(q[i:i + 1], keys, values, c - 1, k_cache.shape[2]))
    return torch.cat(out)


@pytest.mark.parametrize("nh,nkv,d,bs,lens", [
    (4, 4, 16, 4, [1, 4, 5, 13]),       # MHA; one token, a full block, one past, several blocks
    (8, 2, 32, 8, [8, 9, 16, 3]),       # GQA 4:1, block boundaries
    (6, 2, 24, 16, [17, 1, 40]),        # 3 heads per KV head, head dim and G not powers of two
    (2, 1, 16, 3, [7, 6, 2]),           # block size not a power of two
])
def test_decode_equals_the_reference(nh, nkv, d, bs, lens):
    q, kc, vc, tables, lt = random_case(nh, nkv, d, bs, lens, torch.float32, seed=nh * 31 + bs)
    got = PA.decode(q, kc, vc, tables, lt)
    torch.testing.assert_close(got, reference(q, kc, vc, tables, lt), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(dtype):
    q, kc, vc, tables, lt = random_case(4, 2, 16, 4, [5, 12], dtype, seed=7)
    got = PA.decode(q, kc, vc, tables, lt)
    torch.testing.assert_close(got, reference(q, kc, vc, tables, lt), rtol=1e-5, atol=1e-5)
    got_h = PA.decode(q.to(dtype), kc, vc, tables, lt)  # a half-precision model: output in its dtype
    assert got_h.dtype == dtype
    torch.testing.assert_close(got_h.float(), got, rtol=2e-2, atol=2e-2)


def test_rows_are_batch_invariant_and_ignore_the_table_width():
    """A row alone, in a batch, and through a wider table gives the same bits."""
    q, kc, vc, tables, lt = random_case(4, 2, 16, 4, [9, 3, 14], torch.float32, seed=3)
    batch = PA.decode(q, kc, vc, tables, lt)
    wide = torch.cat([tables, torch.zeros(3, 5, dtype=torch.int32)], dim=1)
    assert torch.equal(PA.decode(q, kc, vc, wide, lt), batch)
    for i in range(3):
        alone = PA.decode(q[i:i + 1], kc, vc, tables[i:i + 1].contiguous(), lt[i:i + 1])
        assert torch.equal(alone[0], batch[i])


def test_lengths_and_tables_are_read_at_run_time():
    """The same launch arguments (tensors) with new contents give the new result: nothing about
    the context is taken from the host at launch."""
    q, kc, vc, tables, lt = random_case(4, 2, 16, 4, [6, 11], torch.float32, seed=5, width=4, nb=12)
    first = PA.decode(q, kc, vc, tables, lt)
    lt.copy_(torch.tensor([13, 2], dtype=torch.int32))
    tables.copy_(tables.flip(0))
    second = PA.decode(q, kc, vc, tables, lt)
    torch.testing.assert_close(second, reference(q, kc, vc, tables, lt), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(first, second)


def test_write_kv_lands_at_the_slot_of_each_position():
    gen = torch.Generator().manual_seed(1)
    kc, vc = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    tables = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32)
    positions = torch.tensor([5, 8])
    slots = PA.slots_for(tables, positions, 4)
    assert slots.tolist() == [1 * 4 + 1, 4 * 4 + 0]
    k, v = torch.randn(2, 2, 8, generator=gen), torch.randn(2, 2, 8, generator=gen)
    PA.write_kv(kc, vc, slots, k, v)
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(vc[4, 0], v[1])
    assert int((kc != 0).any(dim=(2, 3)).sum()) == 2


def test_bad_inputs_are_refused():
    q, kc, vc, tables, lt = random_case(4, 2, 16, 4, [5], torch.float32, seed=2)
    with pytest.raises(ValueError, match="multiple of Nkv"):
        PA.decode(torch.randn(1, 3, 16), kc, vc, tables, lt)
    with pytest.raises(ValueError, match="int32"):
        PA.decode(q, kc, vc, tables.long(), lt)
    with pytest.raises(ValueError, match="not supported"):
        PA.decode(q, kc.double(), vc.double(), tables, lt)
