"""Decode tok/s of a streamed-expert MoE on a target device, from bytes and bandwidths.

Per sparse layer ``l`` of one decoded token (batch 1):

    compute_l  = device_bytes_l / device_bw + layer_overhead
    transfer_l = missed_bytes_l / link_bw + missed_experts_l * miss_overhead
    hidden_l   = overlap * transfer_l                      (prefetched behind compute)
    time_l     = max(compute_l, hidden_l) + (transfer_l - hidden_l)

and a token costs ``sum_l time_l + head_bytes / device_bw``. ``device_bytes_l`` is every byte
layer ``l`` reads on the device: its dense weights (attention or linear attention, router,
shared expert) and its ``top_k`` routed experts; ``missed_bytes_l = (1 - hit_rate) * top_k *
expert_bytes`` come over the host-to-device link (hit rate from the trace simulator at the
target's cache size, :func:`engine.experts.simulate.simulate`). ``layer_overhead`` is the fixed
cost of a layer as the step is built (launches or native calls, bookkeeping), measured on it;
``miss_overhead`` the fixed cost of one miss beside its bytes (the cache's bookkeeping, a copy
call), measured too (0 on the targets, where a copy engine moves whole layers); ``overlap`` is the share of the missed bytes whose copy can run behind compute (prefetch
recall; 0 when the step waits for every miss).

:class:`ModelShape` holds the byte counts of a model: the headline shape (``SHAPES["full"]``:
qwen4_exp, 48 layers, hidden 2560, 512 experts of width 640, top-10, one shared expert, 36 Gated
DeltaNet and 12 QSA attention layers at their own byte counts, hyper-connections, and a PLE
n-gram table read from disk a few dozen rows per token) and smaller ones that run on a CPU. :func:`memory_split` divides a
device budget into dense weights, KV cache, recurrent state, workspace and expert slots.

Nothing here imports torch: the arithmetic is checked by tests on hand-made inputs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from dataclasses import dataclass, field, replace

from engine.errors import ConfigError, DeviceBudgetError

__all__ = ["ModelShape", "Target", "SHAPES", "TARGETS", "layer_time", "token_time", "memory_split",
           "MemorySplit", "Prediction", "predict", "int4_expert_bytes", "DENSE_BYTES_PER_PARAM"]

# bytes per dense weight: bf16, int8 with one fp16 scale per 64 weights, fp32
DENSE_BYTES_PER_PARAM = {"bf16": 2.0, "int8": 1 + 2 / 64, "fp32": 4.0}
SLOT_ALIGN = 4096


def int4_expert_bytes(hidden: int, width: int, group: int = 64) -> int:
    """One SwiGLU expert (gate, up: [width, hidden]; down: [hidden, width]) in int4 with an
    fp16 scale and min per ``group`` weights: 4.5 bits per weight at group 64."""
    per_matrix = lambda rows, cols: rows * cols // 2 + 2 * 2 * rows * math.ceil(cols / group)  # noqa: E731
    return 2 * per_matrix(width, hidden) + per_matrix(hidden, width)


@dataclass(frozen=True)
class ModelShape:
    """Byte counts of one MoE model (parameters; formats are applied by the cost model)."""

    name: str
    layers: int
    hidden: int
    experts: int
    expert_width: int
    top_k: int
    shared_width: int  # 0: no shared expert
    vocab: int
    # attention layers (Qwen3-Next: gated attention, q_proj doubled for the gate)
    heads: int
    kv_heads: int
    head_dim: int
    attn_gate: bool = False
    # Gated DeltaNet layers (0 = none): 1 in every ``full_attention_every`` layers is attention
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_head_dim: int = 128
    conv_kernel: int = 4
    full_attention_every: int = 1
    # qwen4_exp's parts (defaults: absent). Hyper-connections: ``hc_count`` residual streams of
    # ``hidden``, a mixer of rank ``hc_lowrank`` before each mixer and MoE block and before the head.
    hc_count: int = 1
    hc_lowrank: int = 0
    # QSA: an indexer (``indexer_heads`` query heads + one key of ``indexer_head_dim``) per attention layer
    indexer_heads: int = 0
    indexer_head_dim: int = 0
    # PLE on ``ple_layers`` DeltaNet layers: projections of ``ple_embed_dim`` on the device, and an
    # n-gram table of ``ple_rows`` rows x (ple_embed_dim / ple_heads) per layer in the PLE tier on
    # disk, of which a token reads ``ple_heads`` rows per layer (one 4 KiB page each)
    ple_layers: int = 0
    ple_embed_dim: int = 0
    ple_heads: int = 0
    ple_rows: int = 0
    ple_conv_kernel: int = 4
    ngram_size: int = 3

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "experts", "expert_width", "top_k", "vocab", "heads",
                     "kv_heads", "head_dim", "full_attention_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"shape {self.name}: {name} must be a positive integer, got {v!r}")
        if self.top_k > self.experts:
            raise ConfigError(f"shape {self.name}: top_k {self.top_k} exceeds experts {self.experts}")

    # ---- per layer ---------------------------------------------------------------------------
    def is_linear(self, layer: int) -> bool:
        return self.linear_key_heads > 0 and (layer + 1) % self.full_attention_every != 0

    @property
    def attention_params(self) -> int:
        q = self.heads * self.head_dim * (2 if self.attn_gate else 1)
        kv = 2 * self.kv_heads * self.head_dim
        return self.hidden * (q + kv) + self.heads * self.head_dim * self.hidden

    @property
    def linear_params(self) -> int:
        kd = self.linear_key_heads * self.linear_head_dim
        vd = self.linear_value_heads * self.linear_head_dim
        conv = (2 * kd + vd) * self.conv_kernel
        return self.hidden * (2 * kd + 2 * vd) + self.hidden * 2 * self.linear_value_heads + conv + vd * self.hidden

    def mixer_params(self, layer: int) -> int:
        return self.linear_params if self.is_linear(layer) else self.attention_params

    @property
    def ffn_dense_params(self) -> int:
        """Router and shared expert (with its gate) of one sparse layer."""
        shared = 3 * self.hidden * self.shared_width + self.hidden if self.shared_width else 0
        return self.experts * self.hidden + shared

    @property
    def hyper_params(self) -> int:
        """One hyper-connection (engine.models.qwen4_exp.tensors.hyper_tensors): grouped norm,
        low-rank down and up mixers over the hc_count x hidden streams, per-stream injection."""
        if self.hc_count <= 1:
            return 0
        width = self.hc_count * self.hidden
        return width + 2 * self.hc_lowrank * width + self.hc_count * width

    @property
    def indexer_params(self) -> int:
        return (self.indexer_heads + 1) * self.indexer_head_dim * self.hidden + 2 * self.indexer_head_dim \
            if self.indexer_heads else 0

    @property
    def ple_layer_params(self) -> int:
        """A PLE layer's device weights (key/value projections, three grouped norms, the conv);
        its n-gram table is not among them (the PLE tier)."""
        width = self.hc_count * self.hidden
        return width * self.ple_embed_dim + self.hidden * self.ple_embed_dim + 3 * width + width * self.ple_conv_kernel

    def is_ple(self, layer: int) -> bool:
        """PLE sits on DeltaNet layers only; counted on the first ``ple_layers`` of them (where
        does not change a byte count)."""
        linear = [l for l in range(self.layers) if self.is_linear(l)]
        return layer in linear[:self.ple_layers]

    def layer_dense_params(self, layer: int) -> int:
        if self.hc_count > 1:  # the hyper-connections' grouped norms replace the two pre-norms
            extra = 2 * self.hyper_params + (self.ple_layer_params if self.is_ple(layer) else 0) + (
                0 if self.is_linear(layer) else self.indexer_params)
            return self.mixer_params(layer) + self.ffn_dense_params + extra
        return self.mixer_params(layer) + self.ffn_dense_params + 2 * self.hidden  # + norms

    @property
    def ple_row_dim(self) -> int:
        return self.ple_embed_dim // self.ple_heads if self.ple_heads else 0

    @property
    def ple_params(self) -> int:
        """The PLE tier: every PLE layer's n-gram table (on disk, never in device or host RAM)."""
        return self.ple_layers * self.ple_rows * self.ple_row_dim

    @property
    def ple_rows_per_token(self) -> int:
        return self.ple_layers * self.ple_heads

    @property
    def expert_bytes(self) -> int:
        return int4_expert_bytes(self.hidden, self.expert_width)

    @property
    def slot_bytes(self) -> int:
        return -(-self.expert_bytes // SLOT_ALIGN) * SLOT_ALIGN

    # ---- whole model -------------------------------------------------------------------------
    @property
    def num_experts_total(self) -> int:
        return self.layers * self.experts

    @property
    def dense_params(self) -> int:
        """Every non-expert weight: layers, embedding, final norm and LM head (untied)."""
        final = (self.hyper_params - self.hc_count * self.hidden * self.hc_count) if self.hc_count > 1 else self.hidden
        return (sum(self.layer_dense_params(l) for l in range(self.layers)) + 2 * self.vocab * self.hidden
                + final)  # + the final norm, or the final mixer (no injection) of hyper-connections

    @property
    def routed_params(self) -> int:
        return self.num_experts_total * 3 * self.hidden * self.expert_width

    @property
    def attention_layers(self) -> int:
        return sum(1 for l in range(self.layers) if not self.is_linear(l))

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return self.attention_layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

    def state_bytes(self) -> int:
        """Recurrent state of the Gated DeltaNet layers for one sequence (fp32)."""
        if not self.linear_key_heads:
            return 0
        kd = self.linear_key_heads * self.linear_head_dim
        vd = self.linear_value_heads * self.linear_head_dim
        per_layer = (2 * kd + vd) * (self.conv_kernel - 1) + self.linear_value_heads * self.linear_head_dim ** 2
        # PLE: the conv window ((K - 1) x ngram_size inputs of hc x hidden) and the n-gram context
        ple = (self.ple_layers * self.hc_count * self.hidden * (self.ple_conv_kernel - 1) * self.ngram_size * 4
               + (self.ngram_size - 1) * 8) if self.ple_layers else 0
        return 4 * per_layer * (self.layers - self.attention_layers) + ple

    def with_layers(self, layers: int) -> "ModelShape":
        return replace(self, name=f"{self.name}-L{layers}", layers=layers)


@dataclass(frozen=True)
class Target:
    """A device: ``device_bw`` bytes/s its kernels read weights at, ``link_bw`` bytes/s of a
    pinned host-to-device copy, ``vram`` bytes, fixed ``layer_overhead_s`` per layer, and the
    share of missed bytes whose copy overlaps compute (``overlap``)."""

    name: str
    device_bw: float
    link_bw: float
    vram: int
    layer_overhead_s: float
    overlap: float = 0.0
    note: str = ""
    miss_overhead_s: float = 0.0
    page_read_s: float = 0.0  # PLE tier: seconds per 4 KiB random read at its queue depth (1 / IOPS)

    def __post_init__(self) -> None:
        if not (self.device_bw > 0 and self.link_bw > 0):
            raise ConfigError(f"target {self.name}: bandwidths must be > 0")
        if not (0.0 <= self.overlap <= 1.0):
            raise ConfigError(f"target {self.name}: overlap must be in [0, 1], got {self.overlap}")
        if self.layer_overhead_s < 0 or self.miss_overhead_s < 0:
            raise ConfigError(f"target {self.name}: overheads must be >= 0")


def layer_time(device_bytes: float, missed_bytes: float, target: Target, missed_experts: float = 0.0) -> float:
    """Seconds for one layer of one token (module docstring)."""
    compute = device_bytes / target.device_bw + target.layer_overhead_s
    transfer = missed_bytes / target.link_bw + missed_experts * target.miss_overhead_s
    hidden = target.overlap * transfer
    return max(compute, hidden) + (transfer - hidden)


def token_time(layers: Sequence[tuple[float, ...]], head_bytes: float, target: Target) -> float:
    """Seconds per token: ``layers`` is ``(device_bytes, missed_bytes[, missed_experts])`` per layer."""
    return sum(layer_time(layer[0], layer[1], target, *layer[2:]) for layer in layers) + head_bytes / target.device_bw


@dataclass(frozen=True)
class MemorySplit:
    budget: int
    dense: int
    kv: int
    state: int
    workspace: int
    slots: int  # bytes of expert slots
    num_slots: int

    def rows(self) -> list[tuple[str, int]]:
        return [("dense weights", self.dense), ("KV cache", self.kv), ("recurrent state", self.state),
                ("workspace + context", self.workspace), ("expert slots", self.slots)]


def memory_split(shape: ModelShape, budget: int, *, dense_format: str = "bf16", context: int = 4096,
                 workspace: int = 0) -> MemorySplit:
    """The device budget divided: dense weights, KV for ``context`` tokens, recurrent state,
    ``workspace`` (activations, CUDA context), and what is left as expert slots. Raises
    :class:`DeviceBudgetError` when the fixed parts leave no room for one token's ``top_k``
    experts."""
    if dense_format not in DENSE_BYTES_PER_PARAM:
        raise ConfigError(f"dense format {dense_format!r}; allowed: {', '.join(DENSE_BYTES_PER_PARAM)}")
    dense = int(shape.dense_params * DENSE_BYTES_PER_PARAM[dense_format])
    kv = shape.kv_bytes_per_token() * context
    state = shape.state_bytes()
    left = budget - dense - kv - state - workspace
    num_slots = max(0, left) // shape.slot_bytes
    if num_slots < shape.top_k:
        raise DeviceBudgetError(
            f"device budget {budget / 2**30:.2f} GiB: dense {dense / 2**30:.2f} GiB + KV {kv / 2**30:.2f} "
            f"GiB + state {state / 2**30:.3f} GiB + workspace {workspace / 2**30:.2f} GiB leave "
            f"{max(left, 0) / 2**30:.2f} GiB, fewer than top_k={shape.top_k} expert slots of "
            f"{shape.slot_bytes} bytes")
    return MemorySplit(budget, dense, kv, state, workspace, num_slots * shape.slot_bytes, num_slots)


@dataclass
class Prediction:
    shape: str
    target: str
    hit_rate: float
    tok_s: float
    token_s: float
    compute_s: float  # sum of the layers' compute parts + head
    transfer_s: float  # sum of the layers' transfers
    device_bytes: float  # per token
    missed_bytes: float  # per token
    split: MemorySplit | None = None
    ple_s: float = 0.0  # PLE rows read from disk per token (not overlapped: an upper bound)
    ple_bytes: float = 0.0  # PLE bytes read from disk per token (whole pages)
    notes: list[str] = field(default_factory=list)


def predict(shape: ModelShape, target: Target, hit_rate: float, *, dense_format: str = "bf16",
            split: MemorySplit | None = None, ple_hit_rate: float = 0.0) -> Prediction:
    """Decode tok/s of ``shape`` on ``target`` at a device expert hit rate ``hit_rate``. A shape
    with a PLE tier reads ``(1 - ple_hit_rate)`` of its rows per token as 4 KiB pages, each
    ``target.page_read_s``, counted beside the layers (the tier prefetches them before layer 1, so
    they overlap the first layers in practice: the figure is a bound)."""
    for name, v in (("hit_rate", hit_rate), ("ple_hit_rate", ple_hit_rate)):
        if not (0.0 <= v <= 1.0):
            raise ConfigError(f"{name} must be in [0, 1], got {v}")
    per_param = DENSE_BYTES_PER_PARAM[dense_format]
    routed = shape.top_k * shape.expert_bytes
    missed = (1.0 - hit_rate) * routed
    n_missed = (1.0 - hit_rate) * shape.top_k
    layers = [(shape.layer_dense_params(l) * per_param + routed, missed, n_missed) for l in range(shape.layers)]
    head = shape.vocab * shape.hidden * per_param
    pages = (1.0 - ple_hit_rate) * shape.ple_rows_per_token
    ple_s = pages * target.page_read_s
    t = token_time(layers, head, target) + ple_s
    compute = sum(d / target.device_bw + target.layer_overhead_s for d, _, _ in layers) + head / target.device_bw
    transfer = shape.layers * (missed / target.link_bw + n_missed * target.miss_overhead_s)
    return Prediction(shape.name, target.name, hit_rate, 1.0 / t, t, compute, transfer,
                      sum(d for d, _, _ in layers) + head, missed * shape.layers, split,
                      ple_s=ple_s, ple_bytes=pages * 4096)


PUBLISHED_QWEN4_EXP = Path(__file__).resolve().parent / "models" / "qwen4_exp" / "published" / "Qwen3.8-Flash-Next.json"


def qwen4_exp_shape(name: str, text: dict) -> "ModelShape":
    """The byte counts of a qwen4_exp text config (config.json's ``text_config``, or the text
    config itself): DeltaNet and QSA layers as ``layer_types`` (or every 4th layer) says,
    hyper-connections, the QSA indexer, the PLE layers and their n-gram tables. A table has
    ``(ngram_size - 1) x heads_per_ngram`` heads of about ``ngram_vocab_size_base`` rows each (the
    heads' primes lie a few hundred above it)."""
    text = text.get("text_config", text)
    types = text.get("layer_types")
    every = 4 if not types else next(i + 1 for i, t in enumerate(types) if t == "full_attention")
    heads = (text["ngram_size"] - 1) * text["heads_per_ngram"]
    return ModelShape(
        name, layers=text["num_hidden_layers"], hidden=text["hidden_size"], experts=text["num_experts"],
        expert_width=text["moe_intermediate_size"], top_k=text["num_experts_per_tok"],
        shared_width=text["shared_expert_intermediate_size"], vocab=text["vocab_size"],
        heads=text["num_attention_heads"], kv_heads=text["num_key_value_heads"], head_dim=text["head_dim"],
        attn_gate=True, linear_key_heads=text["linear_num_key_heads"],
        linear_value_heads=text["linear_num_value_heads"], linear_head_dim=text["linear_key_head_dim"],
        conv_kernel=text["linear_conv_kernel_dim"], full_attention_every=every, hc_count=text["hc_count"],
        hc_lowrank=text["hc_lowrank"], indexer_heads=text.get("indexer_n_heads") or 0,
        indexer_head_dim=text.get("indexer_head_dim") or 0, ple_layers=len(text.get("ple_layer_ids") or []),
        ple_embed_dim=text.get("ple_embed_dim") or 0, ple_heads=heads,
        ple_rows=heads * text["ngram_vocab_size_base"], ple_conv_kernel=text["ple_conv_kernel_size"],
        ngram_size=text["ngram_size"])


# The headline shape: qwen4_exp (Qwen3.8-Flash-Next, 125B-A6B) from its published config as
# reconstructed in engine/models/qwen4_exp/published/ (its README says from what): 48 layers,
# hidden 2560, 36 Gated DeltaNet + 12 QSA layers, 512 experts of width 640 top-10, one shared
# expert, vocab 248,320, hyper-connections (4 streams, rank 320), one PLE layer whose n-gram
# table (16 heads of ~20M rows x 160) is 51.2B parameters.
SHAPES = {
    "full": qwen4_exp_shape("full", json.loads(PUBLISHED_QWEN4_EXP.read_text())),
    # what bench/headline.py runs (the full shape's experts, shared expert and vocabulary; standard
    # attention sized so a layer's dense bytes are within 1% of the qwen4_exp mix's average,
    # hyper-connections and PLE projections included): the full shape's runnable stand-in on a GPU ...
    "full-runnable": ModelShape("full-runnable", layers=48, hidden=2560, experts=512, expert_width=640,
                                top_k=10, shared_width=640, vocab=248320, heads=80, kv_heads=4, head_dim=128),
    # ... and a reduced one that runs on a CPU in well under two minutes
    "small": ModelShape("small", layers=8, hidden=512, experts=64, expert_width=256, top_k=4,
                        shared_width=256, vocab=4096, heads=8, kv_heads=2, head_dim=64),
    "tiny": ModelShape("tiny", layers=2, hidden=128, experts=8, expert_width=64, top_k=2,
                       shared_width=64, vocab=512, heads=4, kv_heads=2, head_dim=32),
}

# NVMe random 4 KiB reads at the PLE tier's queue depth (16): 250k IOPS, a mid-range PCIe 4.0 drive.
NVME_PAGE_READ_S = 4e-6

# Targets. Bandwidths are what kernels and copies achieve, not data-sheet peaks (RTX 4090:
# 1008 GB/s GDDR6X, ~900 read by a good GEMV; PCIe 4.0 x16: 32 GB/s raw, ~25 pinned). The
# per-layer overhead: 3.2 ms is the last GPU measurement of the step (torch layers + per-expert
# Triton launches, 149 a layer: 38.6 tok/s for 8 layers on the H200, docs/benchmarks.md), taken before the
# grouped expert launches were built; bench/headline.py on a GPU measures it again. 0.1 ms is a
# step captured as one grouped launch or CUDA graph per layer.
TARGETS = {
    "rtx4090": Target("RTX 4090 + PCIe 4.0 x16", device_bw=900e9, link_bw=25e9, vram=24 * 2**30,
                      layer_overhead_s=3.2e-3, overlap=0.5, note="step as built", page_read_s=NVME_PAGE_READ_S),
    "rtx4090-graphs": Target("RTX 4090 + PCIe 4.0 x16, one launch/layer", device_bw=900e9, link_bw=25e9,
                             vram=24 * 2**30, layer_overhead_s=1e-4, overlap=0.5,
                             note="per-layer overhead 0.1 ms (grouped launch / CUDA graph)",
                             page_read_s=NVME_PAGE_READ_S),
    "h200-24g": Target("H200, 24 GiB cap", device_bw=4.0e12, link_bw=50e9, vram=24 * 2**30,
                       layer_overhead_s=3.2e-3, overlap=0.5, note="step as built", page_read_s=NVME_PAGE_READ_S),
}
