"""moestream against llama.cpp on this CPU: prefill and decode tokens/s on the same weights, in one
run, beside the memory-bandwidth roofline of each format; then the dispatcher ops and native calls
moestream spends per decoded token, and where its decode time goes, phase by phase.

    python bench/vs_llama_cpp.py                          # the issue's size (12 layers, 512 + 128)
    python bench/vs_llama_cpp.py --layers 2 --prompt 64 --new 32 --rounds 1   # a quick run
    bash bench/build_llama_cpp.sh .llama-native && python bench/vs_llama_cpp.py --llama-lib .llama-native
                      # the wheel's rows and a native build's (GGML_NATIVE) beside them

Weights: a random Qwen3-MoE 1.3B-A0.2B built by transformers with ``torch.manual_seed(0)``
(hidden 1024, 16/4 heads of 64, 64 experts top-8 of intermediate 512, vocab 32000,
norm_topk_prob). One checkpoint feeds both systems:

* moestream: the checkpoint converted to an expert store (int4 g64 experts), dense linears int8
  or bf16, every expert resident from the load on (engine.experts.runtime.load_from_store with
  warm=True, as `moestream generate` loads; prefetch_depth 0; until 2026-12-04 22:50 UTC the
  slots filled on first use, so a timed decode could still meet an expert's first load).
* llama.cpp (through llama-cpp-python): the checkpoint written here as an F32 GGUF (llama.cpp's
  qwen3moe names: stacked ``blk.N.ffn_{gate,up,down}_exps``, dummy 32000-token vocabulary: both
  sides are fed token ids), then quantized by llama.cpp itself (llama_model_quantize) to Q8_0,
  Q4_0 and Q4_K_M. The Q8_0 file is only checked: its greedy tokens against moestream fp32.
  Each format runs in its own child process (bench/llama_child.py): a wheel that dies of SIGILL
  on one format (the prebuilt 0.3.36 wheel on Q4_0 and Q8_0 on AVX-512 VNNI CPUs) loses that
  row only, printed with how it died.

Prompt: ``--prompt`` random ids (torch.Generator seed 1234), then ``--new`` greedy tokens, batch 1,
``--threads`` threads each. Rows alternate inside a round (moestream, llama.cpp, moestream, ...)
after one warm-up run each; the table holds the median of ``--rounds`` rounds, the verdict is
the ratio of the medians, and a line beside it pairs each round's rows (the default over that
round's faster llama.cpp row: the machine's drift between rounds cancels out).

Roofline decode tok/s = measured memory read bandwidth / bytes of weights read per decoded
token: every dense weight once, top_k of the routed experts, one embedding row. For moestream
from the format's bits per weight (bench/decode_cpu.py active_weight_bytes); for llama.cpp from
the GGUF's own tensor types and sizes (Q4_0: 4.5 bits/weight, Q4_K_M ~4.9, its output matrix
Q6_K in both).

llama.cpp is optional: without llama_cpp installed the bench says how to install it and prints
the moestream rows only.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_cpu import active_weight_bytes, measure_bandwidth  # noqa: E402
from llama_child import LlamaCppChild, LlamaCppDied, how_it_ended  # noqa: E402

INSTALL_HINT = ("llama.cpp column skipped: llama_cpp is not installed; install it with "
                "`.venv/bin/pip install --no-deps ../shared/wheels/llama_cpp_python-*.whl numpy "
                "diskcache jinja2` (from the repository root)")

# The issue's model: Qwen3-MoE 1.3B-A0.2B.
ISSUE_SHAPE = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
                   moe_intermediate_size=512, intermediate_size=2816)
# A tiny model of the same family (dimensions multiples of 256, as Q4_K needs): the probe, tests.
TINY_SHAPE = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=256, intermediate_size=512)
PROMPT_SEED = 1234
WEIGHT_SEED = 0
LLAMA_FORMATS = {"Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}  # llama_ftype values (llama.h)
MOESTREAM_DENSE = {"int8": 8.25 / 8, "bf16": 2.0, "int4": 4.5 / 8}  # bytes per weight (g64: fp16 scales)
# (dense format, LM head format or None = as dense): the rows moestream runs; "auto" is what a user
# gets without format flags (engine.quant.linear.resolve_dense: int8 on a CPU with VNNI or AVX2, else bf16)
MOESTREAM_ROWS = [("auto", None), ("int8", "int4"), ("bf16", None)]
DEFAULT_DECODE_GOAL, DEFAULT_PREFILL_GOAL = 1.3, 1.0  # the default row against the faster llama.cpp row


# ---------------------------------------------------------------------------------- the weights

def build_hf(shape: dict | None = None, seed: int = WEIGHT_SEED):
    """(transformers model, moestream ModelConfig) of a random Qwen3-MoE of ``shape``."""
    import transformers as T

    from engine.configio.hf import config_from_hf_dict

    hf_cfg = T.Qwen3MoeConfig(**{**ISSUE_SHAPE, **(shape or {})}, norm_topk_prob=True,
                              max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    hf = T.Qwen3MoeForCausalLM(hf_cfg).eval()
    cfg = config_from_hf_dict({**hf_cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    return hf, cfg


def make_prompt(n: int, vocab: int, seed: int = PROMPT_SEED) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _experts(sd: dict, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked gate [E, I, H], up [E, I, H], down [E, H, I] of one layer, whichever way
    transformers holds them (5.x: fused gate_up_proj [E, 2I, H] and down_proj [E, H, I];
    older: one module per expert)."""
    p = f"model.layers.{layer}.mlp.experts."
    if p + "gate_up_proj" in sd:
        gu, down = sd[p + "gate_up_proj"], sd[p + "down_proj"]
        i = gu.shape[1] // 2
        return gu[:, :i], gu[:, i:], down
    n = len({k.split(".")[5] for k in sd if k.startswith(p)})
    return tuple(torch.stack([sd[f"{p}{e}.{w}_proj.weight"] for e in range(n)])  # type: ignore[return-value]
                 for w in ("gate", "up", "down"))


def gguf_tensors(hf, cfg) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(llama.cpp qwen3moe name, tensor thunk) of every weight, as convert_hf_to_gguf.py names
    them. Qwen uses NEOX rope (rotate_half), so q/k rows are written unpermuted."""
    sd = hf.state_dict()
    yield "token_embd.weight", lambda: sd["model.embed_tokens.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for gname, hname in (("attn_norm", "input_layernorm"), ("attn_q", "self_attn.q_proj"),
                             ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                             ("attn_output", "self_attn.o_proj"), ("attn_q_norm", "self_attn.q_norm"),
                             ("attn_k_norm", "self_attn.k_norm"), ("ffn_norm", "post_attention_layernorm"),
                             ("ffn_gate_inp", "mlp.gate")):
            yield f"blk.{i}.{gname}.weight", (lambda k=p + hname + ".weight": sd[k])
        for j, proj in enumerate(("gate", "up", "down")):
            yield f"blk.{i}.ffn_{proj}_exps.weight", (lambda i=i, j=j: _experts(sd, i)[j])
    yield "output_norm.weight", lambda: sd["model.norm.weight"]
    yield "output.weight", lambda: sd["lm_head.weight"]


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet (the 256 one-character tokens of a 'gpt2' vocabulary)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def gguf_writer(path: Path, cfg, file_type):
    """A GGUFWriter for ``path`` with ``cfg``'s qwen3moe metadata and a dummy byte-level 'gpt2'
    vocabulary of ``vocab_size`` tokens (both sides take token ids); tensors are the caller's."""
    import gguf

    assert cfg.moe is not None and cfg.vocab_size > 258
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name("moestream bench random Qwen3-MoE")
    w.add_file_type(file_type)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope.theta))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_expert_count(cfg.moe.num_experts)
    w.add_expert_used_count(cfg.moe.top_k)
    w.add_expert_feed_forward_length(cfg.moe.expert_intermediate_size)
    w.add_vocab_size(cfg.vocab_size)
    tokens = _byte_chars() + ["Ġt"] + [f"<tok{i}>" for i in range(257, cfg.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * (cfg.vocab_size - 1) + [gguf.TokenType.CONTROL])
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(cfg.vocab_size - 1)
    w.add_bos_token_id(cfg.vocab_size - 1)
    w.add_add_bos_token(False)
    return w


def write_gguf(path: Path, hf, cfg) -> Path:
    """The checkpoint as an F32 GGUF that llama.cpp and moestream both load (:func:`gguf_writer`).
    Tensors are streamed to the file one at a time (the full model never exists twice)."""
    import gguf

    w = gguf_writer(path, cfg, gguf.LlamaFileType.ALL_F32)
    thunks = list(gguf_tensors(hf, cfg))
    for name, fn in thunks:
        t = fn()
        w.add_tensor_info(name, list(t.shape), np.dtype(np.float32), t.numel() * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, fn in thunks:
        w.write_tensor_data(fn().detach().float().contiguous().numpy())
    w.close()
    return path


def gguf_active_bytes(path: Path, cfg, rows_read: dict[str, int] | None = None) -> float:
    """Bytes of weights one decoded token reads from a GGUF: every tensor once, top_k/E of each
    stacked expert tensor, one row of the token embedding (``rows_read``: rows per token of
    other tables, e.g. a PLE table's n-gram heads)."""
    import gguf

    assert cfg.moe is not None
    rows = {"token_embd.weight": 1, **(rows_read or {})}
    total = 0.0
    for t in gguf.GGUFReader(str(path)).tensors:
        n = float(t.n_bytes)
        if "_exps." in t.name:
            n *= cfg.moe.top_k / cfg.moe.num_experts
        elif t.name in rows:
            n *= rows[t.name] / int(t.shape[-1])  # gguf-py's shape: [row width, rows]
        total += n
    return total


def gguf_bits_per_weight(path: Path) -> float:
    import gguf

    ts = gguf.GGUFReader(str(path)).tensors
    return 8 * sum(int(t.n_bytes) for t in ts) / sum(int(t.n_elements) for t in ts)


# ------------------------------------------------------------------------------------ llama.cpp

def have_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llama_cpp_version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "?")


_QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def llama_quantize(src: Path, dst: Path, fmt: str, threads: int, libs: list[Path | None] = (None,)) -> Path:
    """``src`` quantized by llama.cpp itself (llama_model_quantize) to ``fmt`` (a llama_ftype), in a
    child process per try: each build of ``libs`` in turn (a native build's directory, None: the
    installed wheel) until one succeeds, else LlamaCppDied saying how each try ended. A wheel
    built for instructions this CPU lacks dies of SIGILL while quantizing (the 0.3.36 wheel on an
    AVX2-only EPYC, 2026-12-05), and in-process it took the bench down with it."""
    failures = []
    for lib in libs:
        env = {**os.environ, **({"LLAMA_CPP_LIB_PATH": str(lib)} if lib is not None else {})}
        argv = [sys.executable, "-c", _QUANTIZE, str(src), str(dst), str(LLAMA_FORMATS[fmt]), str(threads)]
        r = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode == 0:
            return dst
        err = r.stderr.strip()[-200:] if r.returncode > 0 else ""  # a signal's death: its log says nothing more
        failures.append(f"{lib or 'the wheel'}: {how_it_ended(r.returncode)}" + (f": {err}" if err else ""))
    raise LlamaCppDied(f"llama_model_quantize {src.name} -> {fmt} failed: " + "; ".join(failures))


@contextlib.contextmanager
def _quiet_native_output():
    """Silence what native code writes to stdout/stderr (llama.cpp's per-tensor quantize log)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


class LlamaCpp:
    """One GGUF in llama.cpp; greedy decoding over token ids."""

    def __init__(self, path: Path, threads: int, n_ctx: int, n_batch: int) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                   n_threads=threads, n_threads_batch=threads, flash_attn=True,
                                   verbose=False)
        self.vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        ptr = self._lib.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).argmax())

    def prompt_logits(self, prompt: list[int]) -> np.ndarray:
        """The logits after ``prompt`` (those the first generated token is picked from)."""
        self.llm.reset()
        self.llm.eval(prompt)
        return np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self.llm._ctx.ctx, -1),
                                     shape=(self.vocab,)).copy()

    def greedy(self, prompt: list[int], new: int) -> tuple[list[int], float, float]:
        """(tokens, prefill tok/s, decode tok/s), counted as engine.generate counts them: the
        first token comes out of the prefill, ``new - 1`` decode steps make the rest."""
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(prompt)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        out = [self._argmax()]
        while len(out) < new:
            self.llm.eval([out[-1]])
            out.append(self._argmax())
        decode = time.perf_counter() - t
        return out, len(prompt) / prefill, (new - 1) / decode if new > 1 else 0.0

    def close(self) -> None:
        self.llm.close()


# ------------------------------------------------------------------------------------ moestream

def load_fp32(path: Path):
    """moestream's fp32 model of a checkpoint directory or GGUF (load_model without the tokenizer,
    which a bare checkpoint directory lacks)."""
    from engine.loading import open_model_files
    from engine.models.load import build_model

    files = open_model_files(path)
    return build_model(files.config, files.source)


def moestream_prompt_logits(model, prompt: list[int]) -> np.ndarray:
    from engine.generate import generate_ids
    from engine.layers.sampler import SamplingConfig

    gen = generate_ids(model, prompt, SamplingConfig(max_tokens=1, ignore_eos=True))
    _, logits, _ = next(gen)
    gen.close()
    return logits.float().numpy().copy()


def compare_logits(a: np.ndarray, b: np.ndarray) -> str:
    a, b = a.astype(np.float64), b.astype(np.float64)
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    return (f"cosine {cos:.5f}, max |diff| {np.abs(a - b).max():.4f} (logits' std {a.std():.4f}), "
            f"same argmax: {'yes' if a.argmax() == b.argmax() else 'no'}")


def moestream_greedy(model, prompt: list[int], new: int) -> tuple[list[int], float, float]:
    """Greedy tokens, prefill and decode tok/s through the serving engine (engine.runner)."""
    from engine.layers.sampler import SamplingConfig
    from engine.runner import stream_request

    out, stats = [], None
    for o, stats in stream_request(model, prompt, SamplingConfig(max_tokens=new, temperature=0.0,
                                                                  ignore_eos=True)):
        out += o.new_token_ids
    return out, stats.prefill_tps, stats.decode_tps


@contextlib.contextmanager
def count_native_calls(counts: Counter):
    """Count every call into moestream's native extension (engine/csrc) while inside: each of the
    module's functions is replaced by a counting wrapper (callers look them up on the module at
    call time: the fused step's ``ext.attn_block``, the LM head's ``ext.qlinear``, ...)."""
    from engine.quant.kernels import load_extension

    ext = load_extension()
    if ext is None:
        yield
        return
    saved = {}
    for name in dir(ext):
        fn = getattr(ext, name)
        if name.startswith("_") or isinstance(fn, type) or not callable(fn):
            continue
        saved[name] = fn

        def wrapper(*a, _fn=fn, _name=name, **k):
            counts[_name] += 1
            return _fn(*a, **k)
        setattr(ext, name, wrapper)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(ext, name, fn)


def op_counts(model, prompt: list[int], steps: int) -> dict:
    """Torch profiler events (every dispatcher op, nested ones included) and native calls per
    decoded token, over ``steps`` decode steps after the prompt (sampling included)."""
    from torch.profiler import ProfilerActivity, profile

    from engine.layers.sampler import SamplingConfig
    from engine.runner import stream_request

    gen = stream_request(model, prompt, SamplingConfig(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    next(gen)  # prefill + first token
    next(gen)  # one decode step outside the profiler (first-use work)
    native: Counter = Counter()
    with _quiet_native_output(), profile(activities=[ProfilerActivity.CPU]) as prof:  # quiet: kineto's log
        with count_native_calls(native):
            for _ in range(steps):
                next(gen)
    gen.close()
    ops = Counter()
    for e in prof.key_averages():
        ops[e.key] += e.count
    layers = model.config.num_layers
    n_ops, n_native = sum(ops.values()) / steps, sum(native.values()) / steps
    return dict(ops=n_ops, ops_per_layer=n_ops / layers, native=n_native, native_per_layer=n_native / layers,
                top_ops={k: v / steps for k, v in ops.most_common(12)},
                native_by_name={k: v / steps for k, v in native.most_common()})


def phase_breakdown(model, prompt: list[int], new: int) -> dict | None:
    """Milliseconds per decoded token in each phase of the native step (engine/csrc/phases.h,
    timed on the calling thread), the wall time per token and what is left: Python and the
    native calls' own overhead. None without the native kernels."""
    from engine.layers.sampler import SamplingConfig
    from engine.quant.kernels import load_extension
    from engine.runner import stream_request

    ext = load_extension()
    if ext is None or not hasattr(ext, "phase_times"):
        return None
    gen = stream_request(model, prompt, SamplingConfig(max_tokens=new + 1, temperature=0.0, ignore_eos=True))
    next(gen)  # prefill + first token: not timed
    ext.phase_times(True)
    ext.set_phase_timing(True)
    try:
        t, n = time.perf_counter(), sum(1 for _ in gen)
        wall = (time.perf_counter() - t) / n * 1e3
    finally:
        ext.set_phase_timing(False)
    phases = {k: v / n * 1e3 for k, v in ext.phase_times(True).items()}
    return dict(wall=wall, phases=phases, rest=wall - sum(phases.values()))


# ------------------------------------------------------------------------------------ the bench

def round_ratios(ours: list[float], peers: list[list[float]]) -> list[float]:
    """Round k's figure of ours over the best peer's of the same round (rows that ran back to back
    in it: a slow minute of the machine slows both), for the rounds every row has."""
    n = min([len(ours), *(len(p) for p in peers)])
    return [ours[k] / max(p[k] for p in peers) for k in range(n)]


@dataclass
class Row:
    system: str
    fmt: str
    run: Callable[[], tuple[list[int], float, float]]
    roofline: float
    prefill: list[float]
    decode: list[float]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["issue", "tiny"], default="issue",
                    help="the issue's Qwen3-MoE 1.3B-A0.2B, or a tiny one (a check of the bench itself, seconds)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--check-tokens", type=int, default=16,
                    help="greedy tokens compared between llama.cpp Q8_0 and moestream fp32")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--no-llama", action="store_true", help="moestream rows only")
    ap.add_argument("--llama-lib", action="append", default=[], metavar="DIR",
                    help="a native build of llama.cpp's libraries (bash bench/build_llama_cpp.sh DIR): its rows "
                         "beside the wheel's, each format in its own child (repeatable)")
    args = ap.parse_args(argv)

    from engine.experts.runtime import load_from_store
    from engine.quant.formats import QuantFormat
    from engine.quant.linear import resolve_dense
    from engine.store import convert

    shape = dict(TINY_SHAPE if args.shape == "tiny" else ISSUE_SHAPE)
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    torch.set_num_threads(args.threads)
    bw = measure_bandwidth()
    print(f"threads {args.threads}, memory read bandwidth {bw / 1e9:.1f} GB/s, prompt {args.prompt} tokens, "
          f"{args.new} new tokens, batch 1, {args.rounds} alternating rounds (median), "
          f"Qwen3-MoE random weights ({args.shape} shape), "
          f"{shape['num_hidden_layers']} layers", flush=True)
    llama = not args.no_llama and have_llama_cpp()
    if not llama and not args.no_llama:
        print(INSTALL_HINT)

    fmt = QuantFormat("int4", 64)
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vs_llama_cpp_")))
        # the builds: the installed wheel, and each native build of its libraries asked for
        builds: dict[str, Path | None] = {"llama.cpp": None}
        for d in args.llama_lib:
            if not (Path(d) / "libllama.so").exists():
                raise SystemExit(f"--llama-lib {d}: no libllama.so there (build one: bash bench/build_llama_cpp.sh {d})")
            builds[f"llama.cpp native ({Path(d).name})"] = Path(d).resolve()
        t = time.perf_counter()
        hf, cfg = build_hf(shape)
        prompt = make_prompt(args.prompt, cfg.vocab_size)
        hf.save_pretrained(tmp / "hf")
        convert(tmp / "hf", tmp / "store", fmt=fmt, progress=False)
        ggufs: dict[str, Path] = {}
        quantize_failed: dict[str, str] = {}
        if llama:
            write_gguf(tmp / "f32.gguf", hf, cfg)
            for name in LLAMA_FORMATS:  # by the native builds first (the wheel may not run here)
                try:
                    ggufs[name] = llama_quantize(tmp / "f32.gguf", tmp / f"{name}.gguf", name, args.threads,
                                                 [*(b for b in builds.values() if b is not None), None])
                except LlamaCppDied as e:  # no build quantizes here: no row of that format, said below
                    quantize_failed[name] = str(e)
            (tmp / "f32.gguf").unlink()
        del hf
        gc.collect()
        print(f"weights, store{' and GGUFs' if llama else ''} written in {time.perf_counter() - t:.0f} s",
              flush=True)

        n_ctx, n_batch = args.prompt + args.new + 16, min(args.prompt, 512)
        dead: dict[str, str] = {f"llama.cpp {k}": v for k, v in quantize_failed.items()}  # how a child died

        def start(name: str, build: str = "llama.cpp"):
            try:
                return LlamaCppChild(ggufs[name], args.threads, n_ctx, n_batch, lib=builds[build])
            except LlamaCppDied as e:
                dead[f"{build} {name}"] = str(e)
                return None

        if llama:  # does llama.cpp run the same model? Q8_0 against moestream fp32, on the first build that runs it
            n = min(args.check_tokens, args.new)
            got = q8_logits = checked_on = None
            for b in builds if "Q8_0" in ggufs else ():  # the first build whose Q8_0 runs (the wheel's
                q8 = start("Q8_0", b)                      # dies of SIGILL on some CPUs)
                if q8 is None:
                    continue
                try:
                    q8_logits, got, checked_on = q8.prompt_logits(prompt), q8.greedy(prompt, n)[0], b
                    break
                except LlamaCppDied as e:
                    dead[f"{b} Q8_0"] = str(e)
                finally:
                    q8.close()
            if got is None:
                print(f"llama.cpp Q8_0 check skipped: {'; '.join(dead.values())}", flush=True)
            else:
                ref_model = load_fp32(tmp / "hf")
                ref_logits = moestream_prompt_logits(ref_model, prompt)
                ref = moestream_greedy(ref_model, prompt, n)[0]
                del ref_model
                gc.collect()
                agree = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), n)
                same = sum(a == b for a, b in zip(ref, got))
                print(f"{checked_on} Q8_0 vs moestream fp32, logits after the prompt: "
                      f"{compare_logits(ref_logits, q8_logits)}\n"
                      f"  greedy: first {agree} of {n} tokens agree ({same}/{n} positions equal)\n"
                      f"  moestream fp32 {ref}\n  llama.cpp Q8_0 {got}", flush=True)
            if "Q8_0" in ggufs:
                ggufs.pop("Q8_0").unlink()  # checked: not one of the timed rows

        ours = {}
        default_row = None
        for asked, head in MOESTREAM_ROWS:
            sm = load_from_store(tmp / "store", prefetch_depth=0, **({} if asked == "auto" else {"dense": asked}),
                                 head=head, warm=True)  # every expert in its slot at load, as `generate` does
            stack.callback(sm.close)
            dense = resolve_dense(asked)
            nbytes = active_weight_bytes(cfg, MOESTREAM_DENSE[dense], fmt.bits_per_weight / 8)
            if head is not None:  # the head's weights at their own format
                nbytes -= cfg.vocab_size * cfg.hidden_size * (MOESTREAM_DENSE[dense] - MOESTREAM_DENSE[head])
            label = f"{dense} dense" + (f", {head} head" if head else "") + (" (the default)" if asked == "auto" else "")
            ours[label] = sm.model
            rows.append(Row("moestream", f"store int4 g64 experts, {label}",
                            (lambda m=sm.model: moestream_greedy(m, prompt, args.new)),
                            bw / nbytes, [], []))
            if asked == "auto":
                default_row = rows[-1]
        for build in builds:  # no GGUFs without llama.cpp
            for name, path in ggufs.items():
                lc = start(name, build)
                if lc is None:
                    continue
                stack.callback(lc.close)
                rows.append(Row(build, f"{name} ({gguf_bits_per_weight(path):.2f} bits/weight)",
                                (lambda lc=lc: lc.greedy(prompt, args.new)),
                                bw / gguf_active_bytes(path, cfg), [], []))
        # alternate systems: moestream, llama.cpp, moestream, llama.cpp
        llama_rows = [r for r in rows if r.system != "moestream"]
        our_rows = [r for r in rows if r.system == "moestream"]
        order = [r for pair in zip(our_rows, llama_rows) for r in pair]
        order += [r for r in rows if r not in order]
        def run(r: Row):  # a llama.cpp child that dies takes its row out, not the bench
            try:
                return r.run()
            except LlamaCppDied as e:
                dead[f"{r.system} {r.fmt.split(' (')[0]}"] = str(e)
                order.remove(r)
                rows.remove(r)
                return None

        for r in list(order):  # warm-up: allocations, first touch of the weights, expert loads
            run(r)
        for k in range(args.rounds):
            for r in list(order):
                got = run(r)
                if got is not None:
                    r.prefill.append(got[1])
                    r.decode.append(got[2])
            print(f"round {k + 1}/{args.rounds}: " + ", ".join(
                f"{r.system} {r.fmt.split(' (')[0]} {r.prefill[-1]:.0f}/{r.decode[-1]:.1f}" for r in order),
                flush=True)

        llama_rows = [r for r in rows if r.system != "moestream"]
        for name, why in dead.items():
            print(f"{name}: no row ({why})")
        best_llama = max((statistics.median(r.decode) for r in llama_rows), default=None)
        best_llama_pf = max((statistics.median(r.prefill) for r in llama_rows), default=None)
        print("\n| system | format | prefill tok/s | decode tok/s | roofline decode tok/s | % of roofline "
              "| decode x faster llama.cpp | prefill x faster llama.cpp |")
        print("|---|---|---|---|---|---|---|---|")
        for r in llama_rows + our_rows:
            p, d = statistics.median(r.prefill), statistics.median(r.decode)
            xd = f"{d / best_llama:.2f}x" if best_llama else "n/a"
            xp = f"{p / best_llama_pf:.2f}x" if best_llama_pf else "n/a"
            print(f"| {r.system} | {r.fmt} | {p:.0f} | {d:.1f} | {r.roofline:.1f} | "
                  f"{100 * d / r.roofline:.0f}% | {xd} | {xp} |")

        if best_llama:
            d, p = statistics.median(default_row.decode), statistics.median(default_row.prefill)
            print(f"\ngoal (moestream's default row / the faster llama.cpp row: decode >= {DEFAULT_DECODE_GOAL}x, "
                  f"prefill >= {DEFAULT_PREFILL_GOAL}x): "
                  f"decode {d / best_llama:.3f}x ({'met' if d >= DEFAULT_DECODE_GOAL * best_llama else 'not met'}), "
                  f"prefill {p / best_llama_pf:.3f}x "
                  f"({'met' if p >= DEFAULT_PREFILL_GOAL * best_llama_pf else 'not met'})")
            rd = round_ratios(default_row.decode, [r.decode for r in llama_rows])
            rp = round_ratios(default_row.prefill, [r.prefill for r in llama_rows])
            if len(rd) > 1:  # the machine drifts between rounds; within one the rows ran minutes apart
                print(f"per round (the default / that round's faster llama.cpp row): decode "
                      f"{', '.join(f'{x:.2f}x' for x in rd)} (median {statistics.median(rd):.2f}x), prefill "
                      f"{', '.join(f'{x:.2f}x' for x in rp)} (median {statistics.median(rp):.2f}x)")

        print(f"\nmoestream ops per decoded token (torch profiler, {args.profile_steps} decode steps after "
              f"the prompt, sampling included):")
        for dense, model in ours.items():
            c = op_counts(model, prompt, args.profile_steps)
            print(f"  {dense}: dispatcher ops per token: {c['ops']:.0f} ({c['ops_per_layer']:.1f} per "
                  f"layer), native calls per token: {c['native']:.0f} ({c['native_per_layer']:.1f} per layer)")
            print("    ops: " + ", ".join(f"{k} {v:g}" for k, v in c["top_ops"].items()))
            print("    native: " + ", ".join(f"{k} {v:g}" for k, v in c["native_by_name"].items()))
        print(f"\nwhere a decoded token's time goes (ms, the step's phases timed on its thread, "
              f"{args.new} tokens after the prompt):")
        for dense, model in ours.items():
            b = phase_breakdown(model, prompt, args.new)
            if b is not None:
                print(f"  {dense}: {b['wall']:.2f} per token = " + ", ".join(
                    f"{k} {v:.2f}" for k, v in b["phases"].items()) + f", Python and call overhead {b['rest']:.2f}")


if __name__ == "__main__":
    main()
