"""A model of a given shape whose experts are generated in RAM: no disk, no checkpoint.

For timing a shape that does not exist as weights (the headline 125B-A6B shape is ~65 GB of
experts, more than a lent machine's disk):

- :class:`SyntheticExpertStore` is the store interface the expert cache uses (``config``,
  ``entry``, ``expert_tensors``, ``layout_key``, ``dense_source``) for random int4 experts of
  the shape: one real quantized expert gives the blob layout and valid fp16 scales; every
  expert's 4-bit codes are random bytes (its own window of a seeded random pool).
- :class:`RAMExpertSource` is the host tier: every blob generated straight into one (pinned,
  when CUDA is present) RAM block, and copied into device slots on a miss. It times its copies,
  so the achieved host-to-device bandwidth is measured, not assumed.
- :class:`RandomDenseSource` supplies the dense weights at the model's real size (random, norms
  one), through the same loader a checkpoint goes through (``build_model``).
- :class:`TraceRouting` routes every sparse layer from a routing trace (real, or synthetic with
  skew and locality) while the router's matmul still runs for timing: a random model's routers
  route near-uniformly, which says nothing about a trained MoE.

:func:`build_synthetic_model` puts these together behind the live :class:`ExpertCache`.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from engine.costmodel import ModelShape
from engine.errors import TokenizerNotFoundError
from engine.experts.tiers import ExpertSource, TierCounters, align_up
from engine.loading.source import TensorInfo, TensorSource

__all__ = ["model_config", "SyntheticExpertStore", "RAMExpertSource", "RandomDenseSource",
           "TraceRouting", "build_synthetic_model", "SyntheticModel"]


def model_config(shape: ModelShape):
    """A runnable ModelConfig for ``shape``: Qwen2-MoE layers (attention, routed experts, a
    gated shared expert). Qwen3-Next's linear-attention layers are not run: the cost model
    counts their bytes (:class:`engine.costmodel.ModelShape`)."""
    from engine.config import ModelConfig, MoEConfig

    return ModelConfig(
        arch="qwen2_moe", vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=4 * shape.hidden,
        num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=4096, attention_bias=False,
        moe=MoEConfig(num_experts=shape.experts, top_k=shape.top_k, expert_intermediate_size=shape.expert_width,
                      norm_topk_prob=True, shared_expert_intermediate_size=shape.shared_width,
                      shared_expert_gate=shape.shared_width > 0))


@dataclass(frozen=True)
class _Entry:
    layer: int
    expert: int
    nbytes: int
    layout: dict


class SyntheticExpertStore:
    """Random int4 experts of ``shape`` (module docstring); the blobs live in a
    :class:`RAMExpertSource` made by :meth:`ram_source`."""

    def __init__(self, shape: ModelShape, *, seed: int = 0, group_size: int = 64) -> None:
        from engine.quant.formats import QuantFormat
        from engine.quant.expert_blob import pack_expert

        self.shape = shape
        self.config = model_config(shape)
        self.fmt = QuantFormat("int4", group_size)
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        w = [torch.randn(shape.expert_width, shape.hidden, generator=g) * 0.02,
             torch.randn(shape.expert_width, shape.hidden, generator=g) * 0.02,
             torch.randn(shape.hidden, shape.expert_width, generator=g) * 0.02]
        blob, self.layout = pack_expert(*w, self.fmt)
        self.prototype = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        self.expert_nbytes = len(blob)
        self.read_nbytes = align_up(self.expert_nbytes)
        self.num_experts_total = shape.layers * shape.experts
        # byte ranges of the 4-bit codes inside a blob (randomised per expert)
        self.code_spans = [(t["offset"] + p["offset"], p["nbytes"]) for t in self.layout["tensors"].values()
                           for p in t["parts"] if p["name"] == "codes"]
        self._spans = None
        self._spans_lock = threading.Lock()
        self.path = f"<synthetic {shape.name}>"

    def index(self, layer: int, expert: int) -> int:
        if not (0 <= layer < self.shape.layers and 0 <= expert < self.shape.experts):
            raise KeyError(f"no expert (layer {layer}, expert {expert}) in synthetic store {self.shape.name}: "
                           f"{self.shape.layers} layers x {self.shape.experts} experts")
        return layer * self.shape.experts + expert

    def entry(self, layer: int, expert: int) -> _Entry:
        self.index(layer, expert)
        return _Entry(layer, expert, self.expert_nbytes, self.layout)

    def layout_key(self, layer: int, expert: int) -> int:
        return 0  # one layout for every expert

    def _spans_of(self) -> list:
        from engine.quant.expert_blob import unpack_expert

        with self._spans_lock:
            if self._spans is None:
                probe = torch.zeros(self.expert_nbytes, dtype=torch.uint8)
                base = probe.data_ptr()
                self._spans = [
                    (q.fmt, q.shape, {name: (t.data_ptr() - base, t.numel() * t.element_size(), t.dtype,
                                             tuple(t.shape)) for name, t in q.parts.items()})
                    for q in unpack_expert(probe, self.layout, source=self.path)]
            return self._spans

    def expert_tensors(self, layer: int, expert: int, buf: torch.Tensor):
        """Zero-copy ``(gate, up, down)`` views of a uint8 buffer holding the blob (any device)."""
        from engine.quant.formats import QuantizedTensor

        self.index(layer, expert)
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise ValueError("expert buffer must be a contiguous uint8 tensor")
        flat = buf.reshape(-1)
        if flat.numel() < self.expert_nbytes:
            raise ValueError(f"expert buffer has {flat.numel()} bytes, the blob needs {self.expert_nbytes}")
        out = []
        for fmt, shape, parts in self._spans_of():
            views = {name: flat[off:off + nb].view(dtype).view(pshape)
                     for name, (off, nb, dtype, pshape) in parts.items()}
            q = QuantizedTensor.trusted(fmt, shape, views)
            q.cache["buffer"] = buf
            out.append(q)
        return tuple(out)

    def dense_source(self, verify: bool = True) -> "RandomDenseSource":
        return RandomDenseSource(self.config, seed=self.seed + 1)

    def tokenizer(self):
        raise TokenizerNotFoundError(f"{self.path} has no tokenizer (token ids only)")

    def ram_source(self, *, pin_memory: bool | None = None) -> "RAMExpertSource":
        return RAMExpertSource(self, pin_memory=pin_memory)

    def close(self) -> None:
        """Nothing to release (no files): the ExpertStore interface the cache calls on shutdown."""


class RAMExpertSource(ExpertSource):
    """Every expert blob of a :class:`SyntheticExpertStore` in one RAM block: the prototype's
    layout, scales and mins, random codes (each expert its own window of a seeded pool)."""

    STEP = 4099  # bytes between two experts' windows of the random pool

    def __init__(self, store: SyntheticExpertStore, *, pin_memory: bool | None = None) -> None:
        self.store = store
        self.slot_bytes = align_up(store.expert_nbytes)
        n = store.num_experts_total
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        t0 = time.perf_counter()
        self.buf = torch.empty(n, self.slot_bytes, dtype=torch.uint8, pin_memory=pin)
        # scales and mins: the prototype's, in every blob; codes: expert i reads the random pool
        # from byte i * STEP on (one strided copy per code part for all experts)
        codes = sorted(store.code_spans)
        pos = 0
        for off, nb in codes + [(store.expert_nbytes, 0)]:
            if off > pos:
                self.buf[:, pos:off] = store.prototype[pos:off]
            pos = off + nb
        g = torch.Generator().manual_seed(store.seed + 2)
        longest = max(nb for _, nb in codes)
        step = self.STEP
        pool = torch.randint(0, 256, ((n - 1) * step + longest + len(codes) * step,), dtype=torch.uint8,
                             generator=g)
        for j, (off, nb) in enumerate(codes):
            self.buf[:, off:off + nb] = pool.as_strided((n, nb), (step, 1), j * step)
        self.fill_seconds = time.perf_counter() - t0
        self.pinned = pin
        self.lock = threading.Lock()
        self.ram = TierCounters()
        self.nvme = TierCounters()  # never used: nothing is on disk
        self.copy_seconds = 0.0
        self.copies = 0

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def counters(self) -> dict[str, TierCounters]:
        return {"ram": self.ram, "nvme": self.nvme}

    def likely_in_ram(self, key) -> bool:
        return True

    def bank(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every blob in one block, for the device cache's copy kernel: (block [experts, slot
        bytes], the row of each (layer, expert) [layers, E])."""
        s = self.store.shape
        return self.buf, torch.arange(s.layers * s.experts, dtype=torch.int32).view(s.layers, s.experts)

    def blob(self, key) -> torch.Tensor:
        return self.buf[self.store.index(*key), :self.store.expert_nbytes]

    @contextmanager
    def host_view(self, key) -> Iterator[torch.Tensor]:
        yield self.buf[self.store.index(*key)]

    @torch.inference_mode()
    def read_into(self, key, out: torch.Tensor) -> str:
        src = self.blob(key)
        n = src.numel()
        t0 = time.perf_counter()
        out[:n].copy_(src, non_blocking=out.is_cuda)
        if out.is_cuda:
            torch.cuda.current_stream(out.device).synchronize()
        dt = time.perf_counter() - t0
        with self.lock:
            self.ram.hits += 1
            self.copies += 1
            self.copy_seconds += dt
        return "ram"

    def link_bandwidth(self) -> float:
        """Bytes/s achieved by the copies so far (NaN before the first)."""
        return self.copies * self.store.expert_nbytes / self.copy_seconds if self.copy_seconds else float("nan")


class RandomDenseSource(TensorSource):
    """Random dense weights (normal, std 0.02; norms 1) under the names the model asks for."""

    def __init__(self, config, seed: int = 0) -> None:
        from engine.models.load import skeleton

        self._shapes = {n: tuple(t.shape) for n, t in skeleton(config).state_dict().items()}
        self.seed = seed
        self.path = "<random dense weights>"

    def names(self) -> list[str]:
        return sorted(self._shapes)

    def info(self, name: str) -> TensorInfo:
        return TensorInfo(name, self._shapes[name], "f32")

    def get(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]  # KeyError for an unknown name
        if "norm" in name or len(shape) == 1:
            return torch.ones(shape)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + sum(map(ord, name)))
        scale = 0.5 if name.endswith("mlp.gate.weight") else 0.02
        return torch.randn(shape, generator=g) * scale


class TraceRouting:
    """Routes every sparse layer from ``trace`` (records token by token, layer by layer): the
    router's matmul and softmax still run (their time counts), their top-k is replaced by the
    trace's experts, weighted by the router's renormalised probabilities of those experts.
    Token ``t`` of the run (prefill included) takes the trace's token ``t``.

    ``on_device``: the position in the trace is a device counter advanced by the first sparse
    layer, so routing reads nothing from the host and can be captured in a graph (one graph per
    decode step, engine.cuda_graphs.step_graph: its routes are marked ``capturable``); past the
    trace's end it wraps around instead of raising. A step's rows take consecutive tokens, so
    use it with one sequence (a graph's padding rows would take tokens of their own)."""

    def __init__(self, trace, moe_layers, on_device: bool = False) -> None:
        self.top_k = trace.top_k
        self.layers = sorted(moe_layers)
        if trace.num_layers != len(self.layers):
            raise ValueError(f"trace has {trace.num_layers} layers, the model {len(self.layers)} sparse layers")
        T = trace.num_tokens
        if len(trace) != T * trace.num_layers:
            raise ValueError("TraceRouting needs one record per token and layer")
        self.ids = torch.tensor(trace.experts.astype("int64")).reshape(T, trace.num_layers, trace.top_k)
        self.ordinal = {layer: i for i, layer in enumerate(self.layers)}
        self.pos = 0
        self._on_device = self.ids  # the ids where the model runs (moved once, not per layer)
        self.on_device = on_device
        self.position: torch.Tensor | None = None  # the device counter (on_device)

    def install(self, model) -> None:
        import torch.nn.functional as F

        from engine.layers.moe import Routing

        def make(block):
            gate, ordinal = block.gate, self.ordinal[block.layer]
            first = ordinal == 0

            def route_on_device(x, allowed=None):
                t = x.shape[0]
                if self.position is None or self.position.device != x.device:
                    self._on_device = self.ids.to(x.device)
                    self.position = torch.zeros((), dtype=torch.int64, device=x.device)
                if first:
                    self.position += t
                rows = (self.position - t + torch.arange(t, device=x.device)) % self.ids.shape[0]
                probs = F.softmax(F.linear(x, gate.weight).float(), dim=-1)
                ids = self._on_device[:, ordinal].index_select(0, rows)
                w = torch.gather(probs, 1, ids)
                return Routing(w / w.sum(dim=-1, keepdim=True), ids)

            route_on_device.capturable = True

            def route(x, allowed=None):
                t = x.shape[0]
                if first:
                    self.pos += t
                start = self.pos - t
                if self.pos > self.ids.shape[0]:
                    raise ValueError(f"routing trace has {self.ids.shape[0]} tokens; the run needs more")
                probs = F.softmax(F.linear(x, gate.weight).float(), dim=-1)  # the router's compute
                if self._on_device.device != x.device:
                    self._on_device = self.ids.to(x.device)
                ids = self._on_device[start:self.pos, ordinal]
                w = torch.gather(probs, 1, ids)
                return Routing(w / w.sum(dim=-1, keepdim=True), ids)
            return route_on_device if self.on_device else route

        for block in model.moe_blocks:
            block.router_override = make(block)


@dataclass
class SyntheticModel:
    model: object
    cache: object
    store: SyntheticExpertStore
    source: RAMExpertSource

    def close(self) -> None:
        self.cache.close()

    def __enter__(self) -> "SyntheticModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_synthetic_model(shape: ModelShape, *, device_budget: int, device: str = "cpu", dense: str = "int8",
                          policy: str = "sweep", seed: int = 0, trace=None,
                          source: RAMExpertSource | None = None, admission: bool = False,
                          device_cache: bool = False, trace_on_device: bool = False) -> SyntheticModel:
    """A runnable model of ``shape``: random dense weights quantized to ``dense``, routed experts
    from a :class:`RAMExpertSource` through the live expert cache with ``device_budget`` bytes
    of slots on ``device``; routing from ``trace`` if given (prefetch is then off: predictions
    of a random router say nothing about replayed routing). ``admission``: the cache's admission
    control (:class:`~engine.experts.cache.CacheConfig`: top_k staging slots out of the budget).
    ``device_cache``: the cache's bookkeeping and copies on the device
    (engine.experts.device_cache; the RAM source is its bank); ``trace_on_device``: the trace's
    position as a device counter (:class:`TraceRouting`), so a decode step can be one graph."""
    from engine.experts.cache import CacheConfig, ExpertCache
    from engine.models.load import build_model
    from engine.quant.linear import quantize_dense

    store = source.store if source is not None else SyntheticExpertStore(shape, seed=seed)
    source = source or store.ram_source()
    cfg = store.config
    dense_source = store.dense_source()
    routers = {l: dense_source.get(f"model.layers.{l}.mlp.gate.weight") for l in cfg.moe_layers}
    cls = ExpertCache
    if device_cache:
        from engine.experts.device_cache import DeviceExpertCache as cls
    cache = cls(store, source, CacheConfig(device_budget=device_budget, policy=policy, admission=admission,
                                           prefetch_depth=0 if trace is not None else 1),
                routers=routers, device=device)
    try:
        model = quantize_dense(build_model(cfg, dense_source, provider=cache), dense)
        model.to(device)
        if trace is not None:
            TraceRouting(trace, cfg.moe_layers, on_device=trace_on_device).install(model)
    except BaseException:
        cache.close()
        raise
    return SyntheticModel(model, cache, store, source)
