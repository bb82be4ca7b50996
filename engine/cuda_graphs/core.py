"""Graph seams, decode-step buckets, counters and the model's :class:`GraphSet` (the pool, the
padding index, staging and the capture-or-replay rule every layer graph goes through)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch

from engine.errors import ConfigError

log = logging.getLogger("engine.cuda_graphs")

MAX_ROWS = 64
VERIFY_DRAFTS = (4, 8)  # draft lengths whose verify shapes n * (k + 1) get their own bucket


def decode_buckets(max_rows: int = MAX_ROWS, drafts: Iterable[int] = VERIFY_DRAFTS) -> tuple[int, ...]:
    """Row counts that get a graph: powers of two up to ``max_rows`` and, for each draft length k,
    n * (k + 1) for n = 1, 2, 4, ... (a verify step of n sequences) up to ``max_rows``."""
    if max_rows < 1:
        raise ConfigError(f"max_rows must be >= 1, got {max_rows}")
    out = {1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows}
    for k in drafts:
        if k < 1:
            raise ConfigError(f"draft length must be >= 1, got {k}")
        n = 1
        while n * (k + 1) <= max_rows:
            out.add(n * (k + 1))
            n *= 2
    return tuple(sorted(out))


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= rows, or None (more rows than the largest: run eager)."""
    if rows < 1:
        raise ConfigError(f"a step has at least one row, got {rows}")
    for b in buckets:
        if b >= rows:
            return b
    return None


class Graph(Protocol):
    def capture(self, fn: Callable[[], None]) -> None:
        """Record ``fn`` (which reads and writes static buffers only); does not produce outputs."""

    def replay(self) -> None: ...


class RecordedGraph:
    """The CPU seam: capture keeps the callable (after one warm-up call, as CUDA capture does),
    replay re-runs it on whatever the static buffers hold."""

    def __init__(self, pool: object = None) -> None:
        self.fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        fn()  # warm-up, like CudaGraph's (compiles kernels there)
        self.fn = fn

    def replay(self) -> None:
        assert self.fn is not None, "replay before capture"
        self.fn()


class CudaGraph:
    """``torch.cuda.CUDAGraph`` over a warm-up on a side stream (Triton compiles, cuBLAS picks
    its workspace) and a capture into the model's shared memory pool."""

    def __init__(self, pool: object = None) -> None:
        self.pool = pool
        self.graph = None

    def capture(self, fn: Callable[[], None]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        # thread_local: the expert cache's I/O threads may copy on their stream meanwhile
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            fn()
        self.graph = g

    def replay(self) -> None:
        self.graph.replay()



@dataclass
class GraphCounters:
    captures: int = 0
    replays: int = 0  # graph launches (a sparse layer's step: two)
    eager: int = 0  # feed-forward halves that ran eager (no bucket, restricted routing, ...)
    capture_failures: int = 0
    attention_eager: int = 0  # attention halves of standard layers that ran eager (not pure decode, ...)



def layer_label(layer: torch.nn.Module) -> object:
    """The layer index a log line names (its attention module's ``layer``)."""
    return getattr(getattr(layer, "self_attn", None), "layer", "?")


class GraphSet:
    """A model's per-layer graphs: the factory, the buckets, the shared pool and counters."""

    def __init__(self, factory: Callable[[object], Graph], buckets: tuple[int, ...],
                 attention: bool = True, whole_step: bool = False) -> None:
        self.factory, self.buckets = factory, buckets
        self.attention = attention  # graph the attention halves of pure decode steps too
        # one graph per pure decode step where every layer can (engine.cuda_graphs.step_graph)
        self.whole_step = whole_step and attention
        self.steps: dict = {}  # step_graph entries per (bucket, dtype, table width)
        self._pool: object = None
        self.counters = GraphCounters()
        self.auto, self.generation = False, -1  # made by prepare() from the option (and when)
        self._pad: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        self.inputs: dict = {}  # engine.cuda_graphs.attention.StepInputs per (bucket, width, device)
        self.staged: tuple | None = None  # (layout, kv, bucket, StepInputs) of the step staged last

    def pool(self) -> object:
        """The memory pool every CUDA graph of the model captures into (made on first use)."""
        if self._pool is None and self.factory is CudaGraph:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def pad_index(self, bucket: int, rows: int, device: torch.device) -> torch.Tensor:
        """[bucket] int64 on ``device``: 0..rows-1, then 0 for every padding row."""
        key = (bucket, rows, device)
        t = self._pad.get(key)
        if t is None:
            idx = torch.arange(bucket)
            idx[rows:] = 0
            t = self._pad[key] = idx.to(device)
        return t

    def stage_into(self, dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
        """``src``'s rows into the static buffer ``dst``; padding rows copy row 0."""
        if rows == dst.shape[0]:
            dst.copy_(src)
        else:
            torch.index_select(src.to(dst.dtype), 0, self.pad_index(dst.shape[0], rows, src.device), out=dst)

    def replay(self, e, name: str, fn: Callable[[], None], layer: object = "?") -> bool:
        """Replay graph ``name`` of entry ``e`` (its ``graphs`` dict and ``broken`` flag),
        capturing it from ``fn`` first; False: the capture failed (logged and counted; the entry
        runs eager from now on). The CPU seam re-raises: a test must see the error."""
        g = e.graphs.get(name)
        if g is None:
            g = self.factory(self.pool())
            try:
                g.capture(fn)
            except Exception as err:  # an op that cannot be captured: eager for this entry
                if self.factory is RecordedGraph:
                    raise
                log.warning("CUDA graph capture of layer %s (%s) failed, running eager: %s: %s",
                            layer, name, type(err).__name__, err)
                e.broken = True
                self.counters.capture_failures += 1
                return False
            e.graphs[name] = g
            self.counters.captures += 1
        g.replay()
        self.counters.replays += 1
        return True
