"""moefy: turn a trained dense Llama-family model into a real Mixture-of-Experts checkpoint.

No fine-tuning. Each layer's SwiGLU MLP ``down(silu(gate(x)) * up(x))`` is a sum over its I
intermediate neurons, so any partition of the neurons into groups is an exact decomposition
``mlp(x) = shared(x) + sum_g expert_g(x)``. moefy

1. runs calibration text (engine.text, never the held-out split) through the dense model and
   records, per layer, the MLP input ``x`` [N, H] and ``h = silu(gate(x)) * up(x)`` [N, I];
2. optionally moves the ``shared_fraction`` most important neurons (mean |h_j| times the norm
   of down column j) into an always-on shared expert;
3. clusters the remaining neurons into E equal groups by co-activation: neuron j's profile is
   |h_j| over the N calibration tokens; balanced spherical k-means (deterministic by seed);
   equal sizes so every expert has one intermediate size;
4. fits a ridge least-squares linear router ``x -> log ||expert_g(x)||`` (no bias: the
   standard formats have none) and measures its top-K recall against the oracle (the K groups
   whose contributions are largest) on calibration tokens held out of the fit;
5. writes a standard Hugging Face checkpoint: Mixtral without a shared expert, Qwen2-MoE with one.

Reproducing "selected experts summed with weight 1" inside the standard formats. Both
formats compute ``softmax(logits)`` over all E experts, take the top K and (Mixtral always,
Qwen2-MoE with ``norm_topk_prob=True``) renormalise over the top K. The router weights are
divided by a per-layer factor c, large enough that the scaled logits differ by at most
``log1p(max_weight_deviation)`` on calibration tokens: top-K selection is unchanged (softmax
is monotonic) and each renormalised weight is within that bound of 1/K. Every expert's
down-projection is multiplied by K, so each selected expert contributes with weight
``K * w_k = exp(z_k) / mean_topK exp(z)`` in [1 - d, 1 + d], d ~ max_weight_deviation
(measured and recorded per layer). The Qwen2-MoE shared expert is scaled by
``sigmoid(x @ shared_expert_gate)``: the gate is written as zeros (sigmoid(0) = 0.5 exactly)
and the shared down-projection is doubled, so the shared expert contributes exactly 1x.
With K = E and no shared expert the MoE computes the dense MLP up to that deviation.

The fit does not depend on K (K only changes how many groups are selected), so one
:class:`MoeFit` writes checkpoints for any K (:func:`fit_moe` then :func:`write_checkpoint`);
:func:`moefy` does both.

Shapes: N calibration tokens, H hidden, I dense intermediate, S shared neurons,
E experts, n = (I - S) / E neurons per expert.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.errors import ConfigError, MoestreamError, UnsupportedArchitectureError

FORMAT_VERSION = 1
DEFAULT_CALIB_TOKENS = 6144
DEFAULT_WINDOW = 256
DEFAULT_RIDGE = 1e-2  # lambda = DEFAULT_RIDGE * mean diagonal of X^T X
DEFAULT_MAX_WEIGHT_DEVIATION = 1e-3
VALIDATION_FRACTION = 0.15  # calibration windows held out of the router fit to measure recall
PROBE_TOKENS = 512  # MLP inputs kept per layer to measure the 1/K approximation at write time


# ---- results ----------------------------------------------------------------------------------


@dataclass
class LayerFit:
    """One layer's decomposition. Neuron indices refer to the dense MLP's I rows."""

    groups: np.ndarray  # [E, n] int64, each row sorted: the neurons of expert g
    shared: np.ndarray  # [S] int64 sorted (S = 0: no shared expert)
    router: torch.Tensor  # [E, H] float32: x -> predicted log ||expert_g(x)|| (unscaled)
    logit_spread: float  # max over calibration tokens of max_g r - min_g r
    recall: list[float]  # recall[K-1]: mean top-K router recall vs oracle on validation tokens
    probe: torch.Tensor = field(repr=False)  # [<=PROBE_TOKENS, H] calibration MLP inputs


@dataclass
class MoeFit:
    """Everything :func:`write_checkpoint` needs; independent of top_k."""

    source: str
    config: ModelConfig  # the dense model's
    experts: int
    shared_fraction: float
    shared_size: int
    expert_size: int
    seed: int
    ridge: float
    calibration: dict  # text provenance, tokens, windows, window length
    layers: list[LayerFit]
    dense_state: dict[str, torch.Tensor] = field(repr=False)  # canonical names, float32
    tokenizer: object = field(default=None, repr=False)
    fit_seconds: float = 0.0

    @property
    def format(self) -> str:
        return "qwen2_moe" if self.shared_size else "mixtral"

    def recall(self, top_k: int) -> list[float]:
        """Per-layer router top-K recall on validation calibration tokens."""
        return [lf.recall[top_k - 1] for lf in self.layers]


@dataclass
class MoefySummary:
    out_dir: str
    format: str  # "mixtral" | "qwen2_moe"
    architecture: str
    experts: int
    top_k: int
    expert_size: int
    shared_size: int
    calib_tokens: int
    seed: int
    router_recall: list[float]  # per layer, top-K
    max_weight_deviation: float  # measured max |K * w - 1| over probe tokens, all layers
    fit_seconds: float
    write_seconds: float
    bytes_written: int

    def __str__(self) -> str:
        r = np.asarray(self.router_recall)
        shared = f", shared expert {self.shared_size}" if self.shared_size else ""
        return (
            f"wrote {self.out_dir} ({self.architecture}): {self.experts} experts x {self.expert_size} "
            f"neurons, top-{self.top_k}{shared}; calibration {self.calib_tokens} tokens, seed {self.seed}; "
            f"router top-{self.top_k} recall mean {r.mean():.3f} (min {r.min():.3f}, max {r.max():.3f}); "
            f"max |K*w-1| {self.max_weight_deviation:.1e}; fit {self.fit_seconds:.1f}s, "
            f"write {self.write_seconds:.1f}s, {self.bytes_written / 1e6:.1f} MB")


# ---- sizes ------------------------------------------------------------------------------------


def split_sizes(intermediate: int, experts: int, shared_fraction: float) -> tuple[int, int]:
    """(shared neurons S, neurons per expert n); ConfigError when the routed neurons do not
    divide into ``experts`` equal groups, naming the sizes that would."""
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ConfigError(f"experts must be a positive integer, got {experts!r}")
    if not (0.0 <= shared_fraction < 1.0) or not math.isfinite(shared_fraction):
        raise ConfigError(f"shared_fraction must be in [0, 1), got {shared_fraction!r}")
    shared = int(round(intermediate * shared_fraction))
    routed = intermediate - shared
    if routed < experts:
        raise ConfigError(f"{routed} routed neurons cannot form {experts} experts")
    if routed % experts:
        ok = [e for e in range(2, min(routed, 128) + 1) if routed % e == 0]
        raise ConfigError(
            f"{intermediate} intermediate neurons with shared_fraction {shared_fraction} leave "
            f"{routed} routed neurons, not divisible into {experts} equal experts (every expert "
            f"must have one intermediate size); expert counts that divide {routed}: {ok}")
    return shared, routed // experts


# ---- calibration ------------------------------------------------------------------------------


def _load_dense(src):
    from engine.loading import open_model_files
    from engine.models.load import build_model

    files = open_model_files(src)
    cfg = files.config
    if cfg.arch != "llama" or cfg.moe is not None:
        raise UnsupportedArchitectureError(
            f"{cfg.arch} (moefy needs a dense Llama-family model)", ["llama"])
    model = build_model(cfg, files.source, dtype=torch.float32)
    try:
        tok = files.tokenizer()
    except MoestreamError:  # no tokenizer: can still be moefied from token-id windows
        tok = None
    return model, tok, cfg


@torch.inference_mode()
def capture_mlp(model, windows: Sequence[Sequence[int]], progress: bool = False):
    """Run ``windows`` through ``model`` (each from an empty cache) and return per layer the
    MLP input X [N, H] and the SwiGLU activation h [N, I] (float32), N = total tokens.
    The LM head is skipped: only the decoder layers run."""
    from tqdm import tqdm

    from engine.kv.base import BatchLayout, ContiguousKVCache
    from engine.layers.mlp import SwiGLU

    cfg = model.config
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if not isinstance(layer.mlp, SwiGLU):
            raise UnsupportedArchitectureError(f"layer {i} MLP {type(layer.mlp).__name__}", ["SwiGLU"])
    N = sum(len(w) for w in windows)
    X = torch.empty(cfg.num_layers, N, cfg.hidden_size)
    Hs = torch.empty(cfg.num_layers, N, cfg.intermediate_size)
    pos = [0]
    hooks = []
    for i, layer in enumerate(layers):
        def grab_x(mod, args, i=i):
            x = args[0]
            X[i, pos[0]:pos[0] + x.shape[0]] = x.float()

        def grab_h(mod, args, i=i):
            h = args[0]
            Hs[i, pos[0]:pos[0] + h.shape[0]] = h.float()

        hooks.append(layer.mlp.register_forward_pre_hook(grab_x))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(grab_h))
    try:
        for w in tqdm(windows, desc="calibrate", unit="win", disable=not progress, file=sys.stderr):
            tokens = torch.tensor(list(w), dtype=torch.long)
            layout = BatchLayout.single(0, len(w), 0)
            kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
            cos, sin = model.rotary.cos_sin(layout.positions())
            x = model.model.embed_tokens(tokens)
            for layer in layers:
                x = layer(x, cos, sin, layout, kv)
            pos[0] += len(w)
    finally:
        for h in hooks:
            h.remove()
    return X, Hs


# ---- clustering -------------------------------------------------------------------------------


def balanced_kmeans(profiles: torch.Tensor, k: int, seed: int = 0, iters: int = 25) -> np.ndarray:
    """Spherical k-means of the rows of ``profiles`` [n, D] into ``k`` clusters of exactly n/k
    rows each. Deterministic for a seed. Returns labels [n] int64.

    Assignment step: rows are taken in order of confidence (best minus second-best cosine
    similarity, most confident first), each to its most similar cluster that still has room.
    Stops when an assignment repeats or after ``iters`` rounds."""
    n = profiles.shape[0]
    if n % k:
        raise ConfigError(f"{n} rows do not split into {k} equal clusters")
    cap = n // k
    if k == 1:
        return np.zeros(n, np.int64)
    P = F.normalize(profiles.float(), dim=1)
    rng = np.random.default_rng(seed)
    # k-means++ initialisation on cosine distance
    first = int(rng.integers(n))
    chosen = [first]
    dist = (1 - P @ P[first]).clamp_min(0).double().numpy()
    for _ in range(1, k):
        total = dist.sum()
        p = dist / total if total > 0 else np.full(n, 1.0 / n)
        j = int(rng.choice(n, p=p))
        chosen.append(j)
        dist = np.minimum(dist, (1 - P @ P[j]).clamp_min(0).double().numpy())
    C = P[chosen]
    labels = None
    seen: set[bytes] = set()
    for _ in range(iters):
        sim = (P @ C.T).numpy()  # [n, k]
        new = _balanced_assign(sim, cap)
        key = new.tobytes()
        if key in seen:
            labels = new
            break
        seen.add(key)
        labels = new
        onehot = torch.zeros(k, n)
        onehot[torch.from_numpy(labels), torch.arange(n)] = 1.0
        C = F.normalize(onehot @ P, dim=1)
    return labels


def _balanced_assign(sim: np.ndarray, cap: int) -> np.ndarray:
    n, k = sim.shape
    pref = np.argsort(-sim, axis=1)
    top2 = np.take_along_axis(sim, pref[:, :2], axis=1)
    order = np.argsort(-(top2[:, 0] - top2[:, 1]), kind="stable")
    room = [cap] * k
    labels = np.empty(n, np.int64)
    pref_l = pref.tolist()
    for i in order.tolist():
        for g in pref_l[i]:
            if room[g]:
                room[g] -= 1
                labels[i] = g
                break
    return labels


# ---- routers ----------------------------------------------------------------------------------


def ridge_fit(X: torch.Tensor, Y: torch.Tensor, ridge: float) -> torch.Tensor:
    """W [E, H] minimising ||X W^T - Y||^2 + lam ||W||^2, lam = ridge * mean diag(X^T X)."""
    Xd = X.double()
    G = Xd.T @ Xd
    lam = ridge * float(G.diagonal().mean())
    G.diagonal().add_(lam)
    W = torch.linalg.solve(G, Xd.T @ Y.double())  # [H, E]
    return W.T.float().contiguous()


def topk_recall(pred: torch.Tensor, target: torch.Tensor) -> list[float]:
    """recall[K-1] = mean over tokens of |topK(pred) & topK(target)| / K, for K = 1..E."""
    p, t = pred.numpy(), target.numpy()
    rank_p = np.argsort(np.argsort(-p, axis=1, kind="stable"), axis=1)  # rank of each expert
    rank_t = np.argsort(np.argsort(-t, axis=1, kind="stable"), axis=1)
    E = p.shape[1]
    # both orderings put expert e in the top K  <=>  K > max(rank_p, rank_t)
    both = np.maximum(rank_p, rank_t)  # [N, E]
    hist = np.stack([(both == r).sum(axis=1) for r in range(E)], axis=1).mean(axis=0)  # [E]
    inter = np.cumsum(hist)  # inter[K-1] = mean |intersection of top-K sets|
    return [float(inter[K - 1] / K) for K in range(1, E + 1)]


def group_contributions(h: torch.Tensor, down: torch.Tensor, groups: np.ndarray) -> torch.Tensor:
    """||h[:, G_g] @ down[:, G_g]^T|| per token and group: [N, E]."""
    flat = torch.from_numpy(np.concatenate(list(groups)))
    hp, dp = h[:, flat], down[:, flat].T.contiguous()  # grouped columns, contiguous slices
    out = torch.empty(h.shape[0], len(groups))
    start = 0
    for g, idx in enumerate(groups):
        end = start + len(idx)
        out[:, g] = torch.linalg.vector_norm(hp[:, start:end] @ dp[start:end], dim=1)
        start = end
    return out


# ---- fit --------------------------------------------------------------------------------------


@dataclass
class Calibration:
    """A dense model's recorded MLP traffic on calibration windows; shared by fits with
    different E or shared_fraction (:func:`fit_moe` accepts it in place of a path)."""

    source: str
    model: object = field(repr=False)  # our dense CausalLM
    tokenizer: object = field(repr=False)
    X: torch.Tensor = field(repr=False)  # [L, N, H] MLP inputs
    Hs: torch.Tensor = field(repr=False)  # [L, N, I] silu(gate) * up
    windows: list[list[int]] = field(repr=False)
    info: dict = field(default_factory=dict)  # text provenance, tokens, windows, window
    seconds: float = 0.0

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def calibrate(src, *, calib_tokens: int = DEFAULT_CALIB_TOKENS, window: int = DEFAULT_WINDOW,
              calib_windows: Sequence[Sequence[int]] | None = None, progress: bool = True) -> Calibration:
    """Load the dense model ``src`` and record its MLP inputs and activations on calibration
    text: ``engine.text.calibration_text()`` cut into ``calib_tokens // window`` windows spread
    over the split, or ``calib_windows`` (token ids: tests, models without a tokenizer)."""
    t0 = time.perf_counter()
    model, tok, cfg = _load_dense(src)
    if calib_windows is None:
        from engine import text as text_mod

        if tok is None:
            raise ConfigError(f"{src} has no tokenizer; pass calibration token windows")
        if calib_tokens < window:
            raise ConfigError(f"calib_tokens ({calib_tokens}) must be at least one window ({window})")
        calib_windows = text_mod.windows(tok, text_mod.calibration_text(), window, calib_tokens // window)
        info = {**text_mod.text_info("calibration")}
    else:
        info = {"source": "token ids supplied by the caller"}
    calib_windows = [list(map(int, w)) for w in calib_windows]
    if not calib_windows or any(len(w) < 1 for w in calib_windows):
        raise ConfigError("calibration needs at least one non-empty window")
    info.update(tokens=sum(len(w) for w in calib_windows), windows=len(calib_windows),
                window=max(len(w) for w in calib_windows))
    X, Hs = capture_mlp(model, calib_windows, progress=progress)
    return Calibration(str(src), model, tok, X, Hs, calib_windows, info, time.perf_counter() - t0)


def fit_moe(src, *, experts: int = 16, shared_fraction: float = 0.5,
            calib_tokens: int = DEFAULT_CALIB_TOKENS, window: int = DEFAULT_WINDOW, seed: int = 0,
            ridge: float = DEFAULT_RIDGE, calib_windows: Sequence[Sequence[int]] | None = None,
            progress: bool = True) -> MoeFit:
    """Cluster and fit routers for ``src``: an HF directory or GGUF of a dense Llama
    (calibrated here, see :func:`calibrate` for ``calib_tokens``/``window``/``calib_windows``)
    or a :class:`Calibration` to reuse."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    if isinstance(src, Calibration):
        cal = src
    else:
        from engine.loading import open_model_files

        cfg = open_model_files(src).config  # validate sizes before the expensive part
        if cfg.arch != "llama" or cfg.moe is not None:
            raise UnsupportedArchitectureError(
                f"{cfg.arch} (moefy needs a dense Llama-family model)", ["llama"])
        split_sizes(cfg.intermediate_size, experts, shared_fraction)
        cal = calibrate(src, calib_tokens=calib_tokens, window=window, calib_windows=calib_windows,
                        progress=progress)
    model, tok, cfg, X, Hs = cal.model, cal.tokenizer, cal.config, cal.X, cal.Hs
    shared_size, expert_size = split_sizes(cfg.intermediate_size, experts, shared_fraction)
    if shared_size and cfg.num_heads * cfg.head_dim != cfg.hidden_size:
        raise ConfigError(
            f"Qwen2-MoE (the format with a shared expert) needs head_dim * heads == hidden; this "
            f"model has {cfg.num_heads} x {cfg.head_dim} != {cfg.hidden_size}: use shared_fraction 0")
    if not shared_size and cfg.attention_bias:
        raise ConfigError("the model has q/k/v biases, which Mixtral cannot hold: use "
                          "shared_fraction > 0 (Qwen2-MoE format)")
    calibration = dict(cal.info)
    n_win, N = len(cal.windows), X.shape[1]
    # Router fit / validation split by whole windows (the last VALIDATION_FRACTION of them).
    n_val = max(1, int(round(n_win * VALIDATION_FRACTION))) if n_win > 1 else 0
    n_fit_tokens = sum(len(w) for w in cal.windows[:n_win - n_val])
    gen = torch.Generator().manual_seed(seed)
    probe_idx = torch.randperm(N, generator=gen)[:PROBE_TOKENS].sort().values

    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    layers: list[LayerFit] = []
    for i in tqdm(range(cfg.num_layers), desc="fit layers", unit="layer", disable=not progress,
                  file=sys.stderr):
        x, h = X[i], Hs[i]
        down = state[f"model.layers.{i}.mlp.down_proj.weight"]  # [H, I]
        a = h.abs()
        importance = a.mean(0) * torch.linalg.vector_norm(down, dim=0)  # [I]
        order = torch.argsort(importance, descending=True, stable=True).numpy()
        shared = np.sort(order[:shared_size]).astype(np.int64)
        routed = np.sort(order[shared_size:]).astype(np.int64)
        labels = balanced_kmeans(a[:, torch.from_numpy(routed)].T, experts, seed=seed + 1000 * i)
        groups = np.stack([routed[labels == g] for g in range(experts)])
        # Reorder experts by first neuron so the numbering is canonical for a given partition.
        groups = groups[np.argsort(groups[:, 0])]
        contrib = group_contributions(h, down, groups)  # [N, E]
        eps = 1e-6 * float(contrib.mean()) + 1e-30
        target = torch.log(contrib + eps)
        if n_val:
            W_fit = ridge_fit(x[:n_fit_tokens], target[:n_fit_tokens], ridge)
            recall = topk_recall(x[n_fit_tokens:] @ W_fit.T, contrib[n_fit_tokens:])
        else:
            W_fit = ridge_fit(x, target, ridge)
            recall = topk_recall(x @ W_fit.T, contrib)
        W = ridge_fit(x, target, ridge)
        r = x @ W.T
        spread = float((r.max(1).values - r.min(1).values).max())
        layers.append(LayerFit(groups, shared, W, spread, recall, x[probe_idx].clone()))
    return MoeFit(
        source=cal.source, config=cfg, experts=experts, shared_fraction=float(shared_fraction),
        shared_size=shared_size, expert_size=expert_size, seed=seed, ridge=ridge,
        calibration=calibration, layers=layers, dense_state=state, tokenizer=tok,
        fit_seconds=time.perf_counter() - t0 + (cal.seconds if cal is not src else 0.0))


# ---- checkpoint -------------------------------------------------------------------------------


def router_scale(fit_layer: LayerFit, max_weight_deviation: float) -> float:
    """c such that scaled logits r / c differ by at most log1p(d) on calibration tokens."""
    if not (0 < max_weight_deviation < 1):
        raise ConfigError(f"max_weight_deviation must be in (0, 1), got {max_weight_deviation!r}")
    spread = fit_layer.logit_spread
    return spread / math.log1p(max_weight_deviation) if spread > 0 else 1.0


def weight_deviation(router_scaled: torch.Tensor, probe: torch.Tensor, top_k: int) -> tuple[float, float]:
    """(max, mean) of |K * w - 1| over probe tokens and their top-K experts, with w the
    softmax-top-K-renormalised routing weights the standard formats compute."""
    probs = F.softmax((probe @ router_scaled.T).float(), dim=-1)
    w, _ = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    dev = (top_k * w - 1).abs()
    return float(dev.max()), float(dev.mean())


def routing_facts(fit: MoeFit, top_k: int, *,
                  max_weight_deviation: float = DEFAULT_MAX_WEIGHT_DEVIATION) -> list[dict]:
    """Per layer: router scale c, logit spread, measured |K*w - 1| (max, mean) on calibration
    probe tokens, and router top-K recall."""
    facts = []
    for i, lf in enumerate(fit.layers):
        c = router_scale(lf, max_weight_deviation)
        dmax, dmean = weight_deviation(lf.router / c, lf.probe, top_k)
        facts.append({"layer": i, "router_scale": c, "logit_spread": lf.logit_spread,
                      "weight_deviation_max": dmax, "weight_deviation_mean": dmean,
                      "router_recall": lf.recall[top_k - 1]})
    return facts


def moe_tensors(fit: MoeFit, top_k: int, *,
                max_weight_deviation: float = DEFAULT_MAX_WEIGHT_DEVIATION) -> tuple[dict, list[dict]]:
    """Canonical-name tensors of the MoE model and :func:`routing_facts`."""
    cfg = fit.config
    if not (isinstance(top_k, int) and 1 <= top_k <= fit.experts):
        raise ConfigError(f"top_k must be an integer in [1, experts={fit.experts}], got {top_k!r}")
    out: dict[str, torch.Tensor] = {}
    for name, t in fit.dense_state.items():
        if ".mlp." in name:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        out[name] = t
    facts = routing_facts(fit, top_k, max_weight_deviation=max_weight_deviation)
    for i, lf in enumerate(fit.layers):
        p = f"model.layers.{i}.mlp."
        gate, up, down = (fit.dense_state[p + f"{n}_proj.weight"] for n in ("gate", "up", "down"))
        out[p + "gate.weight"] = (lf.router / facts[i]["router_scale"]).contiguous()
        for j, idx in enumerate(lf.groups):
            idx_t = torch.from_numpy(idx)
            out[p + f"experts.{j}.gate_proj.weight"] = gate[idx_t].contiguous()
            out[p + f"experts.{j}.up_proj.weight"] = up[idx_t].contiguous()
            out[p + f"experts.{j}.down_proj.weight"] = (down[:, idx_t] * top_k).contiguous()
        if fit.shared_size:
            idx_t = torch.from_numpy(lf.shared)
            out[p + "shared_expert.gate_proj.weight"] = gate[idx_t].contiguous()
            out[p + "shared_expert.up_proj.weight"] = up[idx_t].contiguous()
            # sigmoid(0 . x) = 0.5 exactly: doubling down makes the shared expert count 1x.
            out[p + "shared_expert.down_proj.weight"] = (down[:, idx_t] * 2).contiguous()
            out[p + "shared_expert_gate.weight"] = torch.zeros(1, cfg.hidden_size)
    return out, facts


_MIXTRAL_NAMES = (
    (".mlp.gate.", ".block_sparse_moe.gate."),
    (".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2."),
)


def _hf_name(name: str, fmt: str) -> str:
    if fmt != "mixtral" or ".mlp." not in name:
        return name
    name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    if ".mlp.experts." in name:
        name = name.replace(".mlp.experts.", ".block_sparse_moe.experts.")
        for a, b in _MIXTRAL_NAMES[1:]:
            name = name.replace(a, b)
    return name


def _rope_parameters(cfg: ModelConfig) -> dict:
    r = cfg.rope
    p: dict = {"rope_type": r.type, "rope_theta": r.theta}
    if r.type in ("linear", "llama3", "yarn"):
        p["factor"] = r.factor
    if r.type == "llama3":
        p.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                 original_max_position_embeddings=r.original_max_position_embeddings)
    if r.type == "yarn":
        p.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow,
                 original_max_position_embeddings=r.original_max_position_embeddings)
        for k in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(r, k) is not None:
                p[k] = getattr(r, k)
    return p


def hf_config(fit: MoeFit, top_k: int, meta: dict, dtype: torch.dtype) -> dict:
    """config.json of the MoE checkpoint, made by transformers' own config class."""
    import transformers as T

    cfg = fit.config
    eos = list(cfg.eos_token_ids)
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=_rope_parameters(cfg), tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        num_experts_per_tok=top_k, hidden_act="silu",
        dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype],
    )
    if fit.format == "mixtral":
        c = T.MixtralConfig(**common, head_dim=cfg.head_dim, intermediate_size=fit.expert_size,
                            num_local_experts=fit.experts, sliding_window=None)
        arch = "MixtralForCausalLM"
    else:
        c = T.Qwen2MoeConfig(**common, intermediate_size=cfg.intermediate_size,
                             moe_intermediate_size=fit.expert_size, num_experts=fit.experts,
                             shared_expert_intermediate_size=fit.shared_size, norm_topk_prob=True,
                             qkv_bias=cfg.attention_bias, decoder_sparse_step=1, mlp_only_layers=[],
                             use_sliding_window=False)
        arch = "Qwen2MoeForCausalLM"
    d = c.to_dict()
    d["architectures"] = [arch]
    d["moestream_moefy"] = meta
    return d


def write_checkpoint(fit: MoeFit, out_dir, top_k: int, *, dtype: torch.dtype = torch.float32,
                     max_weight_deviation: float = DEFAULT_MAX_WEIGHT_DEVIATION,
                     progress: bool = False) -> MoefySummary:
    """Write ``fit`` as a standard HF checkpoint selecting ``top_k`` experts per token:
    config.json (+ "moestream_moefy"), model.safetensors, moefy.json, generation_config.json
    and the tokenizer when the source had one. Files are written to temporary names and
    renamed, so an interrupted write never leaves a checkpoint that loads half-written."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, facts = moe_tensors(fit, top_k, max_weight_deviation=max_weight_deviation)
    fmt = fit.format
    hf = {_hf_name(n, fmt): t.to(dtype).contiguous() for n, t in tensors.items()}
    recall = [f["router_recall"] for f in facts]
    dmax = max(f["weight_deviation_max"] for f in facts)
    meta = {
        "version": FORMAT_VERSION,
        "source_model": fit.source,
        "format": fmt,
        "experts": fit.experts,
        "top_k": top_k,
        "expert_intermediate_size": fit.expert_size,
        "shared_fraction": fit.shared_fraction,
        "shared_intermediate_size": fit.shared_size,
        "seed": fit.seed,
        "ridge": fit.ridge,
        "calibration": fit.calibration,
        "clustering": "balanced spherical k-means of |silu(gate)*up| profiles over calibration tokens",
        "shared_selection": "top neurons by mean |silu(gate)*up| x ||down column||" if fit.shared_size else None,
        "router": "ridge least squares x -> log ||expert output||, divided by router_scale",
        "combination": ("selected experts summed with weight ~1: router logits scaled down so "
                        "renormalised top-K weights are ~1/K, expert down_proj multiplied by K"
                        + ("; shared expert gate zero (sigmoid 0.5), shared down_proj doubled"
                           if fit.shared_size else "")),
        "max_weight_deviation_target": max_weight_deviation,
        "weight_deviation_max": dmax,
        "router_recall": {"top_k": top_k, "mean": float(np.mean(recall)), "per_layer": recall,
                          "measured_on": f"{VALIDATION_FRACTION:.0%} of calibration windows held out of the fit"},
        "router_recall_by_k": [float(np.mean([lf.recall[k] for lf in fit.layers]))
                               for k in range(fit.experts)],
        "dtype": str(dtype).replace("torch.", ""),
    }
    config = hf_config(fit, top_k, meta, dtype)

    def atomic(path: Path, write) -> None:
        tmp = path.with_name(path.name + ".tmp")
        write(tmp)
        os.replace(tmp, path)

    atomic(out / "model.safetensors",
           lambda p: save_file(hf, str(p), metadata={"format": "pt", "moestream_moefy": "1"}))
    detail = {**meta, "layers": facts,
              "groups": [lf.groups.tolist() for lf in fit.layers],
              "shared": [lf.shared.tolist() for lf in fit.layers] if fit.shared_size else None}
    atomic(out / "moefy.json", lambda p: p.write_text(json.dumps(detail, indent=1)))
    gen = {"bos_token_id": fit.config.bos_token_id, "eos_token_id": list(fit.config.eos_token_ids)}
    atomic(out / "generation_config.json", lambda p: p.write_text(json.dumps(gen, indent=2)))
    if fit.tokenizer is not None:
        fit.tokenizer.hf.save_pretrained(str(out))
    atomic(out / "config.json", lambda p: p.write_text(json.dumps(config, indent=2)))
    nbytes = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return MoefySummary(
        out_dir=str(out), format=fmt, architecture=config["architectures"][0], experts=fit.experts,
        top_k=top_k, expert_size=fit.expert_size, shared_size=fit.shared_size,
        calib_tokens=int(fit.calibration["tokens"]), seed=fit.seed, router_recall=recall,
        max_weight_deviation=dmax, fit_seconds=fit.fit_seconds,
        write_seconds=time.perf_counter() - t0, bytes_written=nbytes)


def moe_model(fit: MoeFit, top_k: int, *, dtype: torch.dtype = torch.float32,
              max_weight_deviation: float = DEFAULT_MAX_WEIGHT_DEVIATION):
    """Our CausalLM of the MoE, built in memory (no files)."""
    from engine.loading.source import DictSource
    from engine.configio.hf import config_from_hf_dict
    from engine.models.load import build_model

    tensors, facts = moe_tensors(fit, top_k, max_weight_deviation=max_weight_deviation)
    meta = {"note": "in memory"}
    cfg = config_from_hf_dict(hf_config(fit, top_k, meta, dtype))
    return build_model(cfg, DictSource(tensors), dtype=dtype)


def moefy(src, out_dir, *, experts: int = 16, top_k: int = 8, shared_fraction: float = 0.5,
          calib_tokens: int = DEFAULT_CALIB_TOKENS, seed: int = 0, progress: bool = True,
          **kwargs) -> MoefySummary:
    """Fit (:func:`fit_moe`) and write (:func:`write_checkpoint`) in one call. ``kwargs``:
    ``window``, ``ridge``, ``calib_windows`` go to the fit; ``dtype``, ``max_weight_deviation``
    to the writer."""
    if not (isinstance(top_k, int) and 1 <= top_k <= experts):
        raise ConfigError(f"top_k must be an integer in [1, experts={experts}], got {top_k!r}")
    write_kw = {k: kwargs.pop(k) for k in ("dtype", "max_weight_deviation") if k in kwargs}
    fit = fit_moe(src, experts=experts, shared_fraction=shared_fraction, calib_tokens=calib_tokens,
                  seed=seed, progress=progress, **kwargs)
    return write_checkpoint(fit, out_dir, top_k, **write_kw)
