"""Quality and routing commands: ``moefy``, ``eval``, ``trace``, ``simulate``.

Registered on the ``moestream`` group by services.cli (``main.add_command(...)``). Each command
also turns typed moestream errors into one line on stderr and exit status 2 by itself, so it
behaves the same when run standalone.
"""

from __future__ import annotations

import math
from pathlib import Path

import click

from services.cli_checks import check_output, check_utf8, writing
from services.cli_checks import typed_errors as _typed_errors


def _text(text_file: str | None, heldout: bool) -> tuple[str, str]:
    """(text, description) from --text FILE or --heldout (the default)."""
    from engine.errors import ConfigError
    from engine.text import heldout_text

    if text_file and heldout:
        raise ConfigError("give either --text FILE or --heldout, not both")
    if text_file:
        try:
            return Path(text_file).read_text(encoding="utf-8"), str(text_file)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read --text {text_file}: {e}") from None
    return heldout_text(), "pydoc_data.topics held-out split"


def _model_arg(model: str | None, store: str | None) -> str:
    from engine.errors import ConfigError

    if bool(model) == bool(store):
        raise ConfigError("give exactly one of --model PATH or --store STORE")
    return model or store


def _dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


# ---- moefy ------------------------------------------------------------------------------------


@click.command("moefy")
@click.argument("src", type=click.Path(exists=True))
@click.option("--experts", type=int, default=16, show_default=True, help="Routed experts per layer (E).")
@click.option("--top-k", "top_k", type=int, default=8, show_default=True, help="Experts selected per token (K).")
@click.option("--shared-fraction", type=float, default=0.5, show_default=True,
              help="Fraction of each MLP's neurons (the most important) in an always-on shared expert; "
                   "0 writes Mixtral format, > 0 Qwen2-MoE.")
@click.option("--calib-tokens", type=int, default=None,
              help="Calibration tokens from the pydoc calibration split [default: 6144].")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Weight dtype of the written checkpoint.")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Checkpoint directory to write.")
@click.option("--progress/--no-progress", default=True, show_default=True)
@_typed_errors
def moefy_cmd(src, experts, top_k, shared_fraction, calib_tokens, seed, dtype, out, progress):
    """Turn the dense Llama-family model SRC (HF directory or .gguf) into a real MoE checkpoint:
    co-activation clustering of each MLP's neurons into experts, a least-squares router."""
    from engine.moefy import DEFAULT_CALIB_TOKENS, moefy

    check_output(out, "--out", directory=True)
    with writing(out, "--out"):
        summary = moefy(src, out, experts=experts, top_k=top_k, shared_fraction=shared_fraction,
                        calib_tokens=calib_tokens or DEFAULT_CALIB_TOKENS, seed=seed,
                        progress=progress, dtype=_dtype(dtype))
    click.echo(str(summary))


# ---- eval -------------------------------------------------------------------------------------


@click.command("eval")
@click.option("--model", type=click.Path(exists=True), default=None, help="HF directory or .gguf.")
@click.option("--store", type=click.Path(exists=True, file_okay=False), default=None, help="Expert store directory.")
@click.option("--reference", required=True, type=click.Path(exists=True),
              help="Reference model (HF directory, .gguf or store) for perplexity ratio and KL.")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="UTF-8 text file to score.")
@click.option("--heldout", is_flag=True, help="Score the pydoc held-out split (the default).")
@click.option("--windows", type=int, default=16, show_default=True, help="Windows to score.")
@click.option("--window", type=int, default=256, show_default=True, help="Tokens per window.")
@click.option("--progress/--no-progress", default=True, show_default=True)
@_typed_errors
def eval_cmd(model, store, reference, text_file, heldout, windows, window, progress):
    """Perplexity of a model and KL(reference || model) per token on held-out text."""
    from engine.errors import ConfigError
    from engine.evaluate import evaluate

    if windows < 1:
        raise ConfigError(f"--windows must be >= 1, got {windows}")
    text, what = _text(text_file, heldout)
    r = evaluate(_model_arg(model, store), reference, text, window=window, max_windows=windows,
                 progress=progress)
    click.echo(f"text        {what}: {r.windows} windows x {window} tokens, {r.tokens} scored")
    click.echo(f"ppl         {r.ppl:.4f}")
    click.echo(f"ref ppl     {r.ref_ppl:.4f}")
    click.echo(f"ratio       {r.ratio:.4f}x")
    click.echo(f"mean KL     {r.mean_kl:.5f} nats/token (max {r.max_kl:.3f})")
    click.echo(f"top-1 agree {100 * r.top1_agreement:.2f}%")


# ---- trace ------------------------------------------------------------------------------------


@click.command("trace")
@click.option("--model", type=click.Path(exists=True), default=None, help="HF directory or .gguf.")
@click.option("--store", type=click.Path(exists=True, file_okay=False), default=None, help="Expert store directory.")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="Trace file (.npz).")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--heldout", is_flag=True, help="Trace the pydoc held-out split (the default).")
@click.option("--tokens", type=int, default=1024, show_default=True,
              help="Prefill tokens to trace (windows of --window).")
@click.option("--window", type=int, default=256, show_default=True)
@click.option("--generate", "prompt", default=None,
              help="Record while greedily generating from PROMPT (chat template) instead of prefill.")
@click.option("--max-tokens", type=int, default=64, show_default=True, help="Tokens to generate with --generate.")
@click.option("--jsonl", is_flag=True, help="Also write TRACE.jsonl.")
@_typed_errors
def trace_cmd(model, store, out, text_file, heldout, tokens, window, prompt, max_tokens, jsonl):
    """Record routing decisions (layer, position, experts) into a trace file: prefill windows of
    text, or the decode steps of a greedy generation (--generate)."""
    from engine.errors import ConfigError
    from engine.evaluate import (expert_nbytes, generation_trace, open_model, routing_stats,
                                 routing_trace, save_trace)

    if tokens < 2 or max_tokens < 1:
        raise ConfigError("--tokens must be >= 2 and --max-tokens >= 1")
    check_output(out, "--out")
    check_utf8(prompt, "--generate PROMPT")
    path = _model_arg(model, store)
    loaded = open_model(path)
    try:
        if loaded.model.config.moe is None:
            raise ConfigError(f"{path} is a dense model: no routing to trace")
        info = {"model": str(path), "expert_bytes": expert_nbytes(loaded)}
        if prompt is not None:
            if loaded.tokenizer is None:
                raise ConfigError(f"{path} has no tokenizer; --generate needs one")
            tok = loaded.tokenizer
            ids = (tok.apply_chat_template([{"role": "user", "content": prompt}])
                   if tok.has_chat_template else tok.encode(prompt))
            eos = sorted(set(tok.eos_token_ids) | set(loaded.model.config.eos_token_ids))
            trace, outs = generation_trace(loaded.model, [ids], max_tokens, eos_ids=eos)
            info.update(mode="generate", prompt=prompt, generated=tok.decode(outs[0]),
                        generated_tokens=len(outs[0]))
        else:
            text, what = _text(text_file, heldout)
            w = min(window, tokens)
            count = max(1, tokens // w)
            trace = routing_trace(loaded.model, loaded.tokenizer, text, count, window=w)
            info.update(mode="prefill", text=what, window=w, windows=count)
    finally:
        loaded.close()
    with writing(out, "--out"):
        written = save_trace(trace, out, info)
        if jsonl:
            trace.to_jsonl(written.with_suffix(".jsonl"))
    stats = routing_stats(trace)
    click.echo(f"wrote {written}: {trace!r}")
    click.echo(f"usage entropy mean {stats['mean_entropy']:.3f}, top-10% share mean "
               f"{100 * stats['mean_top10_share']:.1f}%, expert bytes {info['expert_bytes']}")
    if prompt is not None:
        click.echo(f"generated: {info['generated']!r}")


# ---- simulate ---------------------------------------------------------------------------------


def _fractions(spec: str) -> list[float]:
    from engine.errors import ConfigError

    out = []
    for part in spec.split(","):
        part = part.strip()
        try:
            v = float(part[:-1]) / 100 if part.endswith("%") else float(part)
        except ValueError:
            raise ConfigError(f"--budget {part!r}: expected a percentage like 25% or a fraction like 0.25") from None
        if not (0 < v <= 1) or not math.isfinite(v):
            raise ConfigError(f"--budget {part!r} must be in (0%, 100%]")
        out.append(v)
    return out


@click.command("simulate")
@click.argument("trace_path", metavar="TRACE", type=click.Path(exists=True, dir_okay=False))
@click.option("--budget", default="10%,25%,50%", show_default=True,
              help="Cache budgets as fractions of all experts (comma-separated, e.g. 10%,25%).")
@click.option("--policy", "policies", default="lru,lfu,sweep,belady", show_default=True,
              help="Eviction policies (comma-separated): lru, lfu, lfu-pure, sweep, belady, pinned+<p>.")
@click.option("--per-layer", is_flag=True, help="One pool per layer instead of one global pool.")
@click.option("--bypass", is_flag=True, help="Let policies decline to cache a miss (admission control); "
                                             "the bound is then Belady with bypass.")
@click.option("--expert-bytes", type=int, default=None,
              help="Bytes per expert [default: from the trace's metadata, else 1].")
@click.option("--plot", "plot", type=click.Path(dir_okay=False), default=None, help="Write a hit-rate plot (PNG).")
@_typed_errors
def simulate_cmd(trace_path, budget, policies, per_layer, bypass, expert_bytes, plot):
    """Replay TRACE against expert caches: hit rate and bytes moved per token, per policy and
    budget (Belady's optimum is the bound every policy is judged against)."""
    from engine.errors import ConfigError
    from engine.evaluate import trace_info
    from engine.experts.simulate import budgets_from_fractions, sweep
    from engine.experts.trace import RoutingTrace

    if plot:
        check_output(plot, "--plot")
    try:
        trace = RoutingTrace.load(trace_path)
        info = trace_info(trace_path)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if expert_bytes is None:
        expert_bytes = int(info.get("expert_bytes") or 1)
    if expert_bytes < 0:
        raise ConfigError(f"--expert-bytes must be >= 0, got {expert_bytes}")
    pols = [p.strip() for p in policies.split(",") if p.strip()]
    fracs = _fractions(budget)
    budgets = budgets_from_fractions(trace, fracs, per_layer=per_layer)
    try:
        table = sweep(trace, pols, budgets, per_layer=per_layer, expert_bytes=expert_bytes, bypass=bypass)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    unit = "B" if expert_bytes > 1 else "experts"
    click.echo(f"trace {trace_path}: {trace!r}; {'per-layer' if per_layer else 'global'} pool; "
               f"expert bytes {expert_bytes}")
    click.echo(f"{'policy':>10} {'budget':>7} {'slots':>6} {'hit rate':>9} {'misses/tok':>11} "
               f"{'missed ' + unit + '/tok':>18} {'/Belady' + ('+bypass' if bypass else ''):>8}")
    for r in table.results:
        click.echo(f"{r.policy:>10} {100 * r.budget_fraction:6.1f}% {r.capacity:>6} "
                   f"{100 * r.hit_rate:8.2f}% {r.misses_per_token:11.2f} {r.bytes_missed_per_token:18.1f} "
                   f"{table.ratio(r.policy, r.capacity):8.2f}")
    if plot:
        from engine.experts.plot import plot_hit_rates

        with writing(plot, "--plot"):
            plot_hit_rates(table, plot, title=f"expert cache hit rate: {Path(trace_path).name}")
        click.echo(f"plot: {plot}")


COMMANDS = (moefy_cmd, eval_cmd, trace_cmd, simulate_cmd)
