"""How a step runs: the one place that picks the path of each step of a model.

    executor = executor_for(model)
    logits = executor(tokens, layout, kv, all_logits=False, rows=None)   # as model(...) returns

Per step, in order:

    native   the fused native step (engine.step, on the CPU): built once per model from its
             modules (the architecture names its class: ``model.native_step_type()``), rebuilt
             after a runtime-option change or ``model.modules_changed()``; it returns None for a
             step it cannot run (a KV cache without block tables: FP8), which falls through
    graphs   one graph for the whole step where it can (engine.cuda_graphs.step_graph: pure decode,
             the device expert cache), else the torch layers with per-layer CUDA graphs
             (engine.cuda_graphs) where they are on (``enable`` / ``disable`` on the model, else
             the ``cuda_graphs`` option on CUDA)
    torch    the model's own layers: the reference (``model.forward`` is exactly this path)

around all three: torch's intra-op threads sized to the step (engine.threads) and the model's
per-step state (``model.step_state``: a hybrid model's recurrent state, positioned before and
advanced after). The model modules know none of this; every caller that runs a step (the serving
engine in engine.runner, speculative drafts, engine.generate, engine.evaluate, the benchmarks)
goes through the model's one executor, so the native handles are built once per model.
"""

from __future__ import annotations

import torch

from engine.cuda_graphs import graph_layer, prepare as prepare_graphs
from engine.cuda_graphs.step_graph import run_step
from engine.kv.base import BatchLayout, KVCache
from engine.layers.embedding import compute_dtype
from engine.models.base import CausalLM
from engine.options import generation, options
from engine.step import NativeStep
from engine.threads import step_threads


class Executor:
    """Runs the steps of one model (see the module docstring); one per model: :func:`executor_for`."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self._native: NativeStep | None = None
        self._built_for: tuple[int, int] | None = None  # (option generation, model revision)

    def native(self) -> NativeStep | None:
        """The model's native step if it can run that way now (built on first use and again after
        an option change or ``model.modules_changed()``); None: the torch layers."""
        key = (generation(), self.model.revision)
        if key != self._built_for:
            self._native = self.model.native_step_type().for_model(self.model)
            self._built_for = key
        return self._native

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, layout: BatchLayout, kv: KVCache, all_logits: bool = False,
                 rows: list[int] | None = None) -> torch.Tensor:
        """tokens [T] (flat over the batch) -> logits [T, V] if all_logits, [len(rows), V] for the
        flat rows ``rows`` (speculative verification: a sequence's drafts), else [S, V], one row per
        sequence for its last token; the same values as ``model(...)`` up to the paths' float
        summation order."""
        model = self.model
        device = model.model.embed_tokens.weight.device
        if tokens.device != device:  # callers build them on the CPU
            tokens = tokens.to(device)
        with model.step_state(layout, kv, rows) as state, step_threads(tokens.shape[0], device):
            native = self.native() if device.type == "cpu" else None
            out = native.forward(model, tokens, layout, kv, state, all_logits, rows) if native is not None else None
            if out is None:
                graphs = prepare_graphs(model, device)
                if graphs is not None:
                    out = run_step(model, graphs, tokens, layout, kv, state, all_logits, rows)
            if out is None:
                out = model.run_layers(tokens, layout, kv, state, all_logits, rows,
                                       graph_layer if graphs is not None else None)
            return out


def executor_for(model: CausalLM) -> Executor:
    """The model's executor (made on first use, then the same one: the native step it builds holds
    handles to the model's weights, built once)."""
    ex = model.__dict__.get("_executor")
    if ex is None or ex.model is not model:  # none yet, or one copied along with a model (copy.copy)
        ex = model.__dict__["_executor"] = Executor(model)
    return ex


def kv_dtype(model: CausalLM) -> torch.dtype:
    """The dtype of a KV cache made for ``model`` where the caller names none: bfloat16 where its
    steps run natively on the CPU at float32 (the native attention converts bf16 rows in registers:
    half the bytes a decode step's attention reads, 0.95-1.05 -> 0.68-0.76 ms a token on the 1.3B
    store at a 576-position context; docs/native-step.md), else the dtype the model computes in
    (the torch layers: ``--dense fp32``'s exact parity path, a GPU), or where the ``kv_bf16``
    option is off (``MOESTREAM_KV_BF16=0``). A native step exists only for a CPU model computing in
    float32 (NativeStep.for_model), so that is all it asks."""
    native = options().kv_bf16 and executor_for(model).native() is not None
    return torch.bfloat16 if native else compute_dtype(model)
