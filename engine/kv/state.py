"""Recurrent state of linear-attention layers (Qwen3-Next's Gated DeltaNet) beside the paged KV.

Shape legend:
    Ll  linear-attention layers     S  state slots       C  conv channels     K  conv kernel
    Nv  value heads                 Dk, Dv  key / value head dims

conv    [Ll, S, C, K-1]     float32   each sequence's last K-1 conv inputs
matrix  [Ll, S, Nv, Dk, Dv] float32   each sequence's delta-rule state per value head
slot    seq_id -> slot      tokens    seq_id -> tokens the slot has absorbed

Unlike KV, the state has a fixed size per sequence and is overwritten by every token, so it is
only valid at one position: a forward that starts a sequence at context 0 (a new sequence, or a
recompute after preemption) zeroes its slot, and any other forward must start exactly where the
slot's state stands (``tokens``); anything else (e.g. a speculative rollback without
``restore``) raises :class:`RecurrentStateError` instead of computing from a wrong state.
``snapshot``/``restore`` copy one sequence's state out and back (self-speculation drafts on the
shared cache between them; a recurrent draft model rolls its own state back with them).

Speculative verification: a forward that feeds a sequence ``[last, d_1 .. d_k]`` and asks for
the logits of every one of those rows (the engine's ``rows``) is a verify row. The DeltaNet layers
run it token by token in the recurrent (decode) form and keep the state after each position in a
per-sequence checkpoint (``checkpoint``); after acceptance the engine calls ``keep(seq_id, n)``
and the state at position n is copied back into the slot: rejected drafts cost no recompute.

:class:`HybridKVCache` is what the serving engine holds for such a model: a PagedKVCache for the
attention layers only (their compact indices 0..La-1) plus a RecurrentState whose slots are
allocated together with a sequence's first KV blocks and freed with them (``free``: finish,
abort, preemption), so the scheduler (engine.scheduler) runs unchanged: ``can_allocate`` is
False while a new sequence would find no free slot. ``from_budget`` carves the state slots and
the KV blocks out of one byte budget; ``metrics`` counts both.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.errors import CapacityError, ConfigError, MoestreamError
from engine.kv.base import BatchLayout, KVCache
from engine.kv.paged import KVMetrics, PagedKVCache


class RecurrentStateError(MoestreamError):
    """A forward asked for a sequence's state at a position it does not hold."""


@dataclass(frozen=True)
class StateSnapshot:
    conv: torch.Tensor  # [Ll, C, K-1]
    matrix: torch.Tensor  # [Ll, Nv, Dk, Dv]
    tokens: int


def state_shapes(cfg: ModelConfig) -> tuple[int, tuple[int, int], tuple[int, int, int]]:
    """(linear-attention layers, conv window shape, matrix shape) of one sequence."""
    la = cfg.linear_attn
    if la is None:
        raise ConfigError(f"{cfg.arch} has no linear-attention layers, so no recurrent state")
    layers = sum(1 for i in range(cfg.num_layers) if cfg.is_linear_attention_layer(i))
    return layers, (la.conv_dim, la.conv_kernel - 1), (la.num_value_heads, la.key_head_dim, la.value_head_dim)


def slot_bytes(cfg: ModelConfig) -> int:
    """Bytes of one sequence's state over every linear-attention layer (float32)."""
    layers, conv, mat = state_shapes(cfg)
    extra = getattr(cfg.arch_params, "extra_state_bytes", None)  # e.g. Qwen4-Exp's PLE conv windows
    return layers * (conv[0] * conv[1] + mat[0] * mat[1] * mat[2]) * 4 + (extra(cfg) if extra else 0)


def new_recurrent_state(cfg: ModelConfig, num_slots: int | None = None,
                        device: torch.device | str = "cpu") -> "RecurrentState":
    """The state class of ``cfg``: the architecture's own (``arch_params.recurrent_state``, a
    RecurrentState subclass with more per-sequence state) or a RecurrentState."""
    own = getattr(cfg.arch_params, "recurrent_state", None)
    return own(cfg, num_slots, device) if own is not None else RecurrentState(cfg, num_slots, device)


MAX_CHECKPOINTS = 65  # per-position checkpoints of one verify forward: 1 + the most drafts (64)


class RecurrentState:
    """Slots of per-sequence state. ``num_slots`` None: grow on demand (single-sequence callers
    such as engine.generate); a number: a fixed pool, CapacityError when it is empty."""

    def __init__(self, cfg: ModelConfig, num_slots: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.num_layers, self.conv_shape, self.matrix_shape = state_shapes(cfg)
        if num_slots is not None and num_slots < 1:
            raise ConfigError(f"num_slots={num_slots} is invalid; allowed: >= 1")
        self.growable = num_slots is None
        self.device = torch.device(device)
        self.slot_bytes = slot_bytes(cfg)
        self.conv = self.matrix = torch.empty(0)
        self._alloc(num_slots or 1)
        self._free = list(range(self.capacity))
        self.slot: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        # seq_id -> (first position, conv [Ll, n, C, K-1], matrix [Ll, n, Nv, Dk, Dv]): the state
        # after each of the n tokens of the sequence's last verify forward
        self._checkpoints: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}

    def _alloc(self, n: int) -> None:
        old_c, old_m = self.conv, self.matrix
        self.conv = torch.zeros(self.num_layers, n, *self.conv_shape, device=self.device)
        self.matrix = torch.zeros(self.num_layers, n, *self.matrix_shape, device=self.device)
        if old_c.numel():
            self.conv[:, :old_c.shape[1]] = old_c
            self.matrix[:, :old_m.shape[1]] = old_m

    # ---- accounting ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.conv.shape[1]

    @property
    def num_used(self) -> int:
        return len(self.slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_hold(self, seq_id: int) -> bool:
        return seq_id in self.slot or bool(self._free) or self.growable

    def acquire(self, seq_id: int) -> int:
        """The slot of ``seq_id`` (a zeroed new one if it has none)."""
        if seq_id in self.slot:
            return self.slot[seq_id]
        if not self._free:
            if not self.growable:
                raise CapacityError(f"recurrent state: all {self.capacity} slots in use "
                                    f"({self.slot_bytes} bytes each)")
            old = self.capacity
            self._alloc(2 * old)
            self._free.extend(range(old, self.capacity))
        s = self._free.pop(0)
        self.conv[:, s].zero_()
        self.matrix[:, s].zero_()
        self.slot[seq_id], self.tokens[seq_id] = s, 0
        return s

    def free(self, seq_id: int) -> None:
        s = self.slot.pop(seq_id, None)
        self.tokens.pop(seq_id, None)
        self._checkpoints.pop(seq_id, None)
        if s is not None:
            self._free.append(s)

    # ---- the forward -----------------------------------------------------------------------
    def begin(self, layout: BatchLayout, verify: frozenset[int] = frozenset()) -> None:
        """Position every sequence of ``layout`` at its context length (see the module doc);
        the sequences in ``verify`` get a checkpoint per new token (see ``keep``)."""
        for seq_id, ctx, n in zip(layout.seq_ids, layout.context_lens, layout.query_lens):
            self._checkpoints.pop(seq_id, None)  # a new forward: older checkpoints are void
            if ctx == 0:
                s = self.acquire(seq_id)
                self.conv[:, s].zero_()
                self.matrix[:, s].zero_()
                self.tokens[seq_id] = 0
            elif self.tokens.get(seq_id) != ctx:
                have = self.tokens.get(seq_id)
                raise RecurrentStateError(
                    f"sequence {seq_id}: a forward from position {ctx}, but its recurrent state "
                    + ("does not exist" if have is None else f"stands at position {have}")
                    + "; recompute from 0 or restore a snapshot taken there")
        for seq_id, ctx, n in zip(layout.seq_ids, layout.context_lens, layout.query_lens):
            if seq_id in verify and n <= MAX_CHECKPOINTS:  # longer: no rollback into it (keep raises)
                self._checkpoints[seq_id] = (
                    ctx, torch.empty(self.num_layers, n, *self.conv_shape, device=self.device),
                    torch.empty(self.num_layers, n, *self.matrix_shape, device=self.device))

    def advance(self, layout: BatchLayout) -> None:
        for seq_id, ctx, n in zip(layout.seq_ids, layout.context_lens, layout.query_lens):
            self.tokens[seq_id] = ctx + n

    def layer_state(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (conv window [C, K-1], matrix [Nv, Dk, Dv]) of one DeltaNet layer's state."""
        s = self.slot[seq_id]
        return self.conv[layer, s], self.matrix[layer, s]

    # ---- checkpoints -----------------------------------------------------------------------
    def checkpoint(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-position state buffers (conv [n, C, K-1], matrix [n, Nv, Dk, Dv]) of one DeltaNet
        layer for a verify row of this forward, or None: not a verify row. The layer writes the
        state after its token i into row i."""
        ck = self._checkpoints.get(seq_id)
        return None if ck is None else (ck[1][layer], ck[2][layer])

    @torch.inference_mode()  # the slots may be inference tensors (made inside a forward)
    def keep(self, seq_id: int, n_tokens: int) -> None:
        """After speculative acceptance: the sequence stands at ``n_tokens`` (its last verify
        forward's first position < n_tokens <= where the state stands); the state there comes
        back from the checkpoint (no recompute). The checkpoints are dropped (kept on error)."""
        have = self.tokens.get(seq_id)
        ck = self._checkpoints.get(seq_id)
        if have == n_tokens:
            self._checkpoints.pop(seq_id, None)
            return
        if ck is None or not ck[0] < n_tokens <= have:
            span = "none kept" if ck is None else f"positions {ck[0] + 1}..{have} kept"
            raise RecurrentStateError(f"sequence {seq_id}: keep({n_tokens}) but its state stands at "
                                      f"{have} ({span}); only a verify forward's positions can be kept")
        del self._checkpoints[seq_id]
        s, i = self.slot[seq_id], n_tokens - ck[0] - 1
        self.conv[:, s].copy_(ck[1][:, i])
        self.matrix[:, s].copy_(ck[2][:, i])
        self.tokens[seq_id] = n_tokens

    def snapshot(self, seq_id: int) -> StateSnapshot:
        s = self._slot_of(seq_id)
        return StateSnapshot(self.conv[:, s].clone(), self.matrix[:, s].clone(), self.tokens[seq_id])

    @torch.inference_mode()  # the slots may be inference tensors (made inside a forward)
    def restore(self, seq_id: int, snap: StateSnapshot) -> None:
        s = self._slot_of(seq_id)
        self.conv[:, s].copy_(snap.conv)
        self.matrix[:, s].copy_(snap.matrix)
        self.tokens[seq_id] = snap.tokens

    def _slot_of(self, seq_id: int) -> int:
        if seq_id not in self.slot:
            raise RecurrentStateError(f"sequence {seq_id} holds no recurrent state")
        return self.slot[seq_id]


@dataclass(frozen=True)
class HybridKVMetrics(KVMetrics):
    """KV metrics with the recurrent state: bytes_total/bytes_used include the state slots."""

    state_slots_total: int = 0
    state_slots_used: int = 0
    state_bytes_per_sequence: int = 0


class HybridKVCache(KVCache):
    """Paged KV for the attention layers + recurrent-state slots for the linear-attention ones."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, num_state_slots: int, block_size: int = 16,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", **kw) -> None:
        self.config = cfg
        self.paged = PagedKVCache(len(cfg.attention_layers), cfg.num_kv_heads, cfg.head_dim, num_blocks,
                                  block_size, dtype, device=device, **kw)
        self.state = new_recurrent_state(cfg, num_state_slots, device=device)
        self.block_size = block_size

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return len(cfg.attention_layers) * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem + (
            len(cfg.attention_layers) * 2 * 4 if dtype == torch.float8_e4m3fn else 0)

    @classmethod
    def from_budget(cls, cfg: ModelConfig, budget_bytes: int, block_size: int = 16,
                    dtype: torch.dtype = torch.bfloat16, max_seqs: int = 64, **kw) -> "HybridKVCache":
        """State slots for up to ``max_seqs`` sequences, but at most half the budget, and KV blocks
        from the rest; ConfigError if that leaves no slot or no block."""
        per_slot, per_block = slot_bytes(cfg), cls.block_bytes(cfg, block_size, dtype)
        slots = min(max_seqs, (budget_bytes // 2) // per_slot)
        if slots < 1:
            raise ConfigError(f"KV budget of {budget_bytes} bytes holds no recurrent-state slot: one "
                              f"sequence's state takes {per_slot} bytes and gets at most half the budget")
        blocks = (budget_bytes - slots * per_slot) // per_block
        if blocks < 1:
            raise ConfigError(f"KV budget of {budget_bytes} bytes holds no block after {slots} state "
                              f"slots of {per_slot} bytes: one block of {block_size} tokens takes "
                              f"{per_block} bytes at {dtype}")
        return cls(cfg, blocks, slots, block_size, dtype, **kw)

    # ---- the scheduler's block space -------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.paged.num_blocks

    def blocks_for(self, n_tokens: int) -> int:
        return self.paged.blocks_for(n_tokens)

    def can_allocate(self, seq_id: int, n_tokens: int) -> bool:
        return self.state.can_hold(seq_id) and self.paged.can_allocate(seq_id, n_tokens)

    def allocate(self, seq_id: int, n_tokens: int) -> list[int]:
        if not self.paged.can_allocate(seq_id, n_tokens):  # take nothing if the blocks are short
            return self.paged.allocate(seq_id, n_tokens)  # raises CapacityError
        self.state.acquire(seq_id)
        return self.paged.allocate(seq_id, n_tokens)

    def block_table(self, seq_id: int) -> list[int]:
        return self.paged.block_table(seq_id)

    def free(self, seq_id: int) -> None:
        self.paged.free(seq_id)
        self.state.free(seq_id)

    # ---- the model's view ------------------------------------------------------------------
    def store_and_load(self, layer, seq_id, start, k, v):
        """``layer``: the attention layer's compact index (engine.layers.gated_attention)."""
        self.state.acquire(seq_id)
        return self.paged.store_and_load(layer, seq_id, start, k, v)

    def native_view(self, layout, device):
        """The attention layers' paged KV (compact indices) for the native step (engine.models.qwen3_next.step)."""
        return self.paged.native_view(layout, device)

    def recurrent_state(self) -> RecurrentState:
        return self.state

    # ---- speculative rollback (engine.runner.Engine, engine.speculative) --------------------
    def keep(self, seq_id: int, n_tokens: int) -> None:
        """After acceptance: the sequence continues from ``n_tokens``. The paged KV beyond is
        stale and overwritten later; the recurrent state comes back from its checkpoint."""
        self.state.keep(seq_id, n_tokens)

    def snapshot(self, seq_id: int) -> StateSnapshot:
        return self.state.snapshot(seq_id)

    def restore(self, seq_id: int, snap: StateSnapshot) -> None:
        self.state.restore(seq_id, snap)

    def metrics(self) -> HybridKVMetrics:
        m = self.paged.metrics()
        st = self.state
        return HybridKVMetrics(
            blocks_total=m.blocks_total, blocks_used=m.blocks_used, blocks_free=m.blocks_free,
            block_size=m.block_size, bytes_total=m.bytes_total + st.capacity * st.slot_bytes,
            bytes_used=m.bytes_used + st.num_used * st.slot_bytes,
            num_sequences=len(set(self.paged.tables) | set(st.slot)), tokens_stored=m.tokens_stored,
            state_slots_total=st.capacity, state_slots_used=st.num_used,
            state_bytes_per_sequence=st.slot_bytes)


def recurrent_state_for(kv: KVCache, cfg: ModelConfig) -> RecurrentState:
    """The RecurrentState a forward over ``kv`` uses: a HybridKVCache's own; for any other cache
    (the contiguous one of engine.generate) a growable one kept beside it for its lifetime."""
    own = getattr(kv, "recurrent_state", None)
    if callable(own):
        return own()
    if isinstance(kv, PagedKVCache):  # the engine's cache frees sequences; state must go with them
        raise ConfigError(f"{cfg.arch} keeps recurrent state per sequence: serve it with a "
                          "HybridKVCache (engine.kv.state.kv_cache_from_budget), not a bare PagedKVCache")
    state = _SIDE.get(kv)
    if state is None:
        state = _SIDE[kv] = new_recurrent_state(cfg)
    return state


_SIDE: "weakref.WeakKeyDictionary[KVCache, RecurrentState]" = weakref.WeakKeyDictionary()


def snapshot_state(kv: KVCache, seq_id: int) -> StateSnapshot | None:
    """The recurrent state ``seq_id`` has over ``kv`` (a HybridKVCache's, or the side state of
    any other cache), copied; None when there is none (a model without recurrent state, or a
    sequence that has not started): nothing needs restoring then."""
    own = getattr(kv, "recurrent_state", None)
    state = own() if callable(own) else _SIDE.get(kv)
    if state is None or seq_id not in state.slot:
        return None
    return state.snapshot(seq_id)


def restore_state(kv: KVCache, seq_id: int, snap: StateSnapshot | None) -> None:
    """Put back what :func:`snapshot_state` took (None: nothing to do)."""
    if snap is None:
        return
    own = getattr(kv, "recurrent_state", None)
    state = own() if callable(own) else _SIDE.get(kv)
    if state is None:
        raise RecurrentStateError(f"sequence {seq_id}: a snapshot to restore but no recurrent state")
    state.acquire(seq_id)
    state.restore(seq_id, snap)


def kv_cache_from_budget(cfg: ModelConfig, budget_bytes: int, block_size: int = 16,
                         dtype: torch.dtype = torch.bfloat16, max_seqs: int = 64, **kw) -> KVCache:
    """The serving engine's cache for ``cfg`` within ``budget_bytes``: a HybridKVCache when the
    model has linear-attention layers, else a PagedKVCache."""
    if cfg.linear_attn is not None:
        return HybridKVCache.from_budget(cfg, budget_bytes, block_size, dtype, max_seqs=max_seqs, **kw)
    return PagedKVCache.from_budget(cfg, budget_bytes, block_size, dtype, **kw)
