"""Quality harness: perplexity and KL divergence against a reference model on held-out text,
and routing traces recorded from a model's own routers.

Each window of ``window`` tokens runs from an empty KV cache; the first position has no
prediction, so a window of T tokens scores T - 1 next-token predictions. Per scored position

    nll_model = -log p_model(next token)        ppl = exp(mean nll)
    kl        = sum_v p_ref(v) (log p_ref(v) - log p_model(v))     KL(reference || model)

``mean_kl`` is the mean over scored positions (nats per token). Model and reference must share
the tokenizer's vocabulary; windows are cut with the model's tokenizer.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from engine.errors import ConfigError
from engine.executor import executor_for
from engine.layers.embedding import compute_dtype

DEFAULT_WINDOW = 256
DEFAULT_MAX_WINDOWS = 16


@dataclass(frozen=True)
class EvalResult:
    ppl: float  # the model's perplexity
    ref_ppl: float  # the reference's perplexity on the same positions
    mean_kl: float  # mean KL(reference || model) per scored token, nats
    tokens: int  # scored positions (windows x (window - 1))
    windows: int = 0
    max_kl: float = float("nan")  # largest per-token KL
    top1_agreement: float = float("nan")  # fraction of positions where both argmaxes agree

    @property
    def ratio(self) -> float:
        return self.ppl / self.ref_ppl

    def __str__(self) -> str:
        return (f"ppl {self.ppl:.3f}  ref ppl {self.ref_ppl:.3f}  ratio {self.ratio:.3f}x  "
                f"mean KL {self.mean_kl:.4f} nats/token  top-1 agreement {100 * self.top1_agreement:.1f}%  "
                f"({self.tokens} tokens, {self.windows} windows)")


@dataclass
class Loaded:
    """A model ready to run: our CausalLM, its tokenizer, and what to close afterwards."""

    model: object
    tokenizer: object
    path: str
    closer: object = None

    def close(self) -> None:
        if self.closer is not None:
            self.closer.close()


def open_model(path_or_store, dtype: torch.dtype = torch.float32) -> Loaded:
    """An HF directory or GGUF file (engine.loading.load_model), an expert store directory
    (has manifest.json: engine.experts.runtime.load_from_store), or an already built
    ``(model, tokenizer)`` pair / :class:`Loaded`."""
    if isinstance(path_or_store, Loaded):
        return path_or_store
    if isinstance(path_or_store, tuple):
        model, tok = path_or_store
        return Loaded(model, tok, "<memory>")
    path = Path(path_or_store)
    if path.is_dir() and (path / "manifest.json").is_file():
        from engine.experts.runtime import load_from_store

        # fp32 dense: eval measures what the store's expert formats cost, nothing else
        sm = load_from_store(path, dtype=dtype, dense="fp32")
        return Loaded(sm.model, sm.tokenizer, str(path), sm)
    from engine.loading import load_model

    model, tok, _ = load_model(path, dtype=dtype)
    return Loaded(model, tok, str(path))


@torch.inference_mode()
def window_logits(model, ids: Sequence[int]) -> torch.Tensor:
    """Logits [T, V] (float32, on the CPU whatever the model's device) of one window run from an
    empty cache."""
    from engine.kv.base import BatchLayout, ContiguousKVCache

    cfg = model.config
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                           dtype=compute_dtype(model))
    return executor_for(model)(torch.tensor(list(ids), dtype=torch.long), BatchLayout.single(0, len(ids), 0), kv,
                               all_logits=True).to("cpu", torch.float32)


def _windows(tokenizer, text, window: int, max_windows: int | None) -> list[list[int]]:
    """``text`` is a string (cut with the tokenizer) or already a list of token-id windows."""
    if isinstance(text, str):
        from engine.text import windows

        if tokenizer is None:
            raise ConfigError("the model has no tokenizer: pass token-id windows instead of text")
        return windows(tokenizer, text, window, max_windows or None, strict=False)
    wins = [list(map(int, w)) for w in text]
    if max_windows:
        wins = wins[:max_windows]
    if not wins or any(len(w) < 2 for w in wins):
        raise ConfigError("need at least one window of >= 2 tokens")
    return wins


@dataclass
class ReferenceRun:
    """A reference model's log-probabilities on fixed windows, computed once and reused to
    score many models (:func:`evaluate` accepts it in place of a reference path)."""

    path: str
    windows: list[list[int]]
    logprobs: list[torch.Tensor]  # per window [T - 1, V] float32
    vocab_size: int
    tokenizer: object = None


def reference_run(reference, text, *, window: int = DEFAULT_WINDOW,
                  max_windows: int | None = DEFAULT_MAX_WINDOWS, progress: bool = True,
                  dtype: torch.dtype = torch.float32) -> ReferenceRun:
    """Run the reference once over the windows of ``text`` (memory: windows x T x V floats)."""
    from tqdm import tqdm

    r = open_model(reference, dtype)
    try:
        wins = _windows(r.tokenizer, text, window, max_windows)
        lps = [F.log_softmax(window_logits(r.model, ids)[:-1], dim=-1)
               for ids in tqdm(wins, desc="reference", unit="win", disable=not progress, file=sys.stderr)]
        return ReferenceRun(r.path, wins, lps, r.model.config.vocab_size, r.tokenizer)
    finally:
        if r is not reference:
            r.close()


def evaluate(model_path_or_store, reference_path, text, *, window: int = DEFAULT_WINDOW,
             max_windows: int | None = DEFAULT_MAX_WINDOWS, progress: bool = True,
             dtype: torch.dtype = torch.float32) -> EvalResult:
    """Perplexity of the model and of the reference, and mean KL(reference || model), over
    held-out windows of ``text`` (a string, or a list of token-id windows).

    Model and reference: paths (HF dir, GGUF, expert store), ``(model, tokenizer)`` pairs or
    :class:`Loaded`; the reference may also be a :class:`ReferenceRun` (then its windows are
    scored and ``text`` is ignored). Only one window's logits of each are held at a time."""
    m = open_model(model_path_or_store, dtype)
    try:
        if isinstance(reference_path, ReferenceRun):
            ref = reference_path
        else:
            r = open_model(reference_path, dtype)
            try:
                _check_compatible(m, r.model.config.vocab_size, r.tokenizer, r.path)
                wins = _windows(m.tokenizer, text, window, max_windows)
                ref = ReferenceRun(r.path, wins, [], r.model.config.vocab_size, r.tokenizer)
                ref_model = r.model
                return _score(m, ref, ref_model, progress)
            finally:
                if r is not reference_path:
                    r.close()
        _check_compatible(m, ref.vocab_size, ref.tokenizer, ref.path)
        return _score(m, ref, None, progress)
    finally:
        if m is not model_path_or_store:
            m.close()


def _score(m: Loaded, ref: ReferenceRun, ref_model, progress: bool) -> EvalResult:
    from tqdm import tqdm

    nll_m = nll_r = kl_sum = 0.0
    kl_max, agree, n = 0.0, 0, 0
    for w, ids in enumerate(tqdm(ref.windows, desc="eval", unit="win", disable=not progress,
                                 file=sys.stderr)):
        lm = F.log_softmax(window_logits(m.model, ids)[:-1], dim=-1)
        lr = (F.log_softmax(window_logits(ref_model, ids)[:-1], dim=-1) if ref_model is not None
              else ref.logprobs[w])
        target = torch.tensor(ids[1:], dtype=torch.long)
        nll_m += float(-lm.gather(1, target[:, None]).sum())
        nll_r += float(-lr.gather(1, target[:, None]).sum())
        kl = (lr.exp() * (lr - lm)).sum(-1).clamp_min(0)
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        agree += int((lm.argmax(-1) == lr.argmax(-1)).sum())
        n += len(ids) - 1
    return EvalResult(ppl=math.exp(nll_m / n), ref_ppl=math.exp(nll_r / n), mean_kl=kl_sum / n,
                      tokens=n, windows=len(ref.windows), max_kl=kl_max, top1_agreement=agree / n)


def _check_compatible(m: Loaded, ref_vocab: int, ref_tokenizer, ref_path: str) -> None:
    vm = m.model.config.vocab_size
    if vm != ref_vocab:
        raise ConfigError(f"model vocabulary {vm} != reference vocabulary {ref_vocab}: KL needs the same vocabulary")
    if m.tokenizer is not None and ref_tokenizer is not None:
        probe = "The quick brown fox: def f(x): return x ** 2  # comment"
        if m.tokenizer.encode(probe) != ref_tokenizer.encode(probe):
            raise ConfigError(f"{m.path} and {ref_path} tokenize text differently; KL needs one tokenizer")


# ---- routing ----------------------------------------------------------------------------------


def routing_trace(model, tokenizer, text, windows: int | Sequence[Sequence[int]] = 4, *,
                  window: int = DEFAULT_WINDOW, progress: bool = False):
    """Run prefill windows through ``model`` and record every sparse layer's top-k choices
    (through the SparseMoE route observers) as a :class:`RoutingTrace`: one sequence per
    window, records in execution order (layer by layer; within a layer, token by token).

    ``windows``: how many windows of ``text`` to cut (``tokenizer`` needed), or token-id
    windows (``text`` and ``tokenizer`` unused). Trace layers are MoE-layer ordinals
    (0..len(moe_layers)-1); equal to model layers when every layer is sparse."""
    from tqdm import tqdm

    if isinstance(windows, int):
        wins = _windows(tokenizer, text, window, windows)
    else:
        wins = _windows(None, windows, window, None)
    rec, blocks, ordinal = _recorder(model)

    def observe(layer: int, ids: torch.Tensor) -> None:
        # prefill: positions 0..T-1 of the current window
        for t, row in enumerate(ids.tolist()):
            rec.record(t, ordinal[layer], row)

    for b in blocks:
        b.observers.append(observe)
    try:
        for w in tqdm(wins, desc="trace", unit="win", disable=not progress, file=sys.stderr):
            rec.new_sequence()
            window_logits(model, w)
    finally:
        for b in blocks:
            b.observers.remove(observe)
    return rec.trace()


def generation_trace(model, prompts: Sequence[Sequence[int]], max_tokens: int, *,
                     eos_ids: Sequence[int] = (), include_prompt: bool = False):
    """Record routing while greedily generating from each prompt through the serving engine
    (engine.runner.Engine, one request at a time). Decode steps are recorded with their absolute
    position; prefill records only with ``include_prompt``. Returns (trace, generated id lists)."""
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine

    rec, blocks, ordinal = _recorder(model)
    state = {"pos": 0, "prefill": True}

    def observe(layer: int, ids: torch.Tensor) -> None:
        if state["prefill"]:
            if include_prompt:
                for t, row in enumerate(ids.tolist()):
                    rec.record(t, ordinal[layer], row)
            return
        for row in ids.tolist():
            rec.record(state["pos"], ordinal[layer], row)

    outputs = []
    for b in blocks:
        b.observers.append(observe)
    try:
        for prompt in prompts:
            rec.new_sequence()
            engine = Engine.for_requests(model, None, len(prompt) + max_tokens,
                                         max_batched_tokens=max(512, len(prompt)))
            engine.eos_ids = frozenset(eos_ids)  # exactly the caller's stop ids
            engine.add_request("trace", list(prompt), SamplingConfig(max_tokens=max_tokens, temperature=0.0))
            seq = engine.scheduler.get("trace")
            out: list[int] = []
            while engine.has_unfinished():
                # the whole prompt is one prefill step; then each step decodes the last token
                state.update(prefill=seq.num_computed_tokens < len(prompt), pos=seq.num_tokens - 1)
                for o in engine.step():
                    out += o.new_token_ids
            outputs.append(out)
    finally:
        for b in blocks:
            b.observers.remove(observe)
    return rec.trace(), outputs


def _recorder(model):
    from engine.experts.trace import TraceRecorder

    cfg = model.config
    if cfg.moe is None:
        raise ConfigError(f"{cfg.arch} model has no routed experts: nothing to trace")
    blocks = model.moe_blocks
    ordinal = {layer: i for i, layer in enumerate(cfg.moe_layers)}
    return TraceRecorder(len(cfg.moe_layers), cfg.moe.num_experts, cfg.moe.top_k), blocks, ordinal


def routing_stats(trace) -> dict:
    """Per-layer normalised usage entropy (1 = uniform) and share of picks taken by the top
    10% of experts, plus their means."""
    from engine.experts.trace import top_share, usage_entropy

    ent = usage_entropy(trace)
    share = top_share(trace, 0.1)
    return {
        "records": len(trace),
        "tokens": trace.num_tokens,
        "entropy": ent.tolist(),
        "top10_share": share.tolist(),
        "mean_entropy": float(np.nanmean(ent)) if np.isfinite(ent).any() else float("nan"),
        "mean_top10_share": float(np.nanmean(share)) if np.isfinite(share).any() else float("nan"),
    }


# ---- trace files with provenance ----------------------------------------------------------------

TRACE_INFO_KEY = "moestream_info"  # extra npz array: JSON text (RoutingTrace.load ignores it)


def save_trace(trace, path, info: dict | None = None) -> Path:
    """``trace.save(path)`` plus a JSON ``info`` object (model, text, expert bytes, ...) in the
    same .npz, which :meth:`RoutingTrace.load` reads unchanged."""
    import json

    from engine.experts.trace import replaced_atomically

    path = Path(trace.save(path))
    if info:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        arrays[TRACE_INFO_KEY] = np.array(json.dumps(info, sort_keys=True))
        with replaced_atomically(path) as f:
            np.savez_compressed(f, **arrays)
    return path


def trace_info(path) -> dict:
    """The ``info`` object :func:`save_trace` stored, or {} when there is none."""
    import json

    with np.load(Path(path), allow_pickle=False) as z:
        if TRACE_INFO_KEY not in z.files:
            return {}
        try:
            info = json.loads(str(z[TRACE_INFO_KEY]))
        except json.JSONDecodeError:
            return {}
    return info if isinstance(info, dict) else {}


def expert_nbytes(loaded: Loaded) -> int:
    """Bytes of one routed expert as the model's files hold it (store: the quantized blob;
    checkpoint: 3 matrices at the model's parameter dtype)."""
    closer = loaded.closer
    if closer is not None and hasattr(getattr(closer, "store", None), "expert_nbytes"):
        return int(closer.store.expert_nbytes)
    cfg = loaded.model.config
    m = cfg.moe
    if m is None:
        return 0
    elem = loaded.model.model.embed_tokens.weight.element_size()
    return 3 * cfg.hidden_size * m.expert_intermediate_size * elem
