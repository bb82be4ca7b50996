"""``moestream serve | scale | status | shutdown`` and ``generate_remote`` (``generate --address``).

    moestream serve store/ --loaders 2 --ram-budget 8GiB --device-budget 16GiB   # local cluster
    moestream serve store/ --address auto        # into a running `ray start --head` cluster
    moestream scale --loaders 3 --address auto
    moestream status --address auto
    moestream shutdown --address auto
    ray job submit --address http://127.0.0.1:8265 -- moestream generate --address auto "Hi"
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from typing import Any, Callable, TextIO

import click

from engine.errors import ConfigError, MoestreamError
from services.cli_checks import (check_budget, check_utf8, device_memory, fail as _fail, host_memory,
                                 one_line_errors)


@click.command()
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.option("--address", default=None, help="Join this cluster ('auto', HOST:6379); default: "
              "start a local cluster that lives as long as this command.")
@click.option("--namespace", default="moestream", show_default=True)
@click.option("--loaders", type=int, default=2, show_default=True)
@click.option("--device-budget", default=None, help="Device bytes for experts, e.g. 16GiB.")
@click.option("--ram-budget", default=None, help="RAM-tier bytes, all loaders together.")
@click.option("--kv-budget", default="256MiB", show_default=True)
@click.option("--policy", default="lfu", show_default=True)
@click.option("--prefetch-depth", type=int, default=None,
              help="Sparse layers ahead to prefetch; default 1 on a GPU, 0 on CPU.")
@click.option("--queue-size", type=int, default=64, show_default=True)
@click.option("--request-timeout", type=float, default=300.0, show_default=True)
@click.option("--dtype", default="fp32", show_default=True)
@click.option("--dashboard/--no-dashboard", default=False, help="Local cluster only: start the "
              "dashboard/Jobs server on 127.0.0.1:8265 (needed by `ray job submit`).")
@click.option("--num-cpus", type=int, default=None)
@click.option("--object-store-memory", default="512MiB", show_default=True)
@click.option("--compute-threads", type=int, default=None,
              help="Intra-op CPU threads of the decode actor; default: every core of its node.")
@click.option("--io-threads", type=int, default=2, show_default=True,
              help="Decode-side threads copying experts into device slots.")
def serve(store, address, namespace, loaders, device_budget, ram_budget, kv_budget, policy,
          prefetch_depth, queue_size, request_timeout, dtype, dashboard, num_cpus,
          object_store_memory, compute_threads, io_threads):
    """Deploy the pipeline (router, decode, N loaders) for STORE."""
    from pydantic import ValidationError

    from services.app import deploy
    from services.config import DeployConfig

    try:
        cfg = DeployConfig(store=store, address=address, namespace=namespace, loaders=loaders,
                           device_budget=device_budget, ram_budget=ram_budget, kv_budget=kv_budget,
                           policy=policy, prefetch_depth=prefetch_depth, queue_size=queue_size,
                           request_timeout_s=request_timeout, dtype=dtype,
                           include_dashboard=dashboard, num_cpus=num_cpus,
                           object_store_memory=object_store_memory, compute_threads=compute_threads,
                           io_threads=io_threads)
    except ValidationError as e:
        _fail("; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()))
    if address is None:  # a local cluster: the budgets must fit this machine
        check_local_budgets(cfg, device_budget, ram_budget)
    app = deploy(cfg)
    click.echo(json.dumps(app.status(), indent=2, default=str))
    if app.owns_cluster:  # the cluster dies with this process: serve until interrupted
        click.echo("serving on a local cluster; Ctrl-C stops it", err=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
        app.shutdown()


def check_local_budgets(cfg, device_text: object, ram_text: object) -> None:
    """Refuse, before any actor starts, budgets larger than this machine (a local cluster)."""
    import torch

    if cfg.ram_budget is not None:
        check_budget("--ram-budget", ram_text, cfg.ram_budget, host_memory(), "RAM")
    if cfg.device_budget is not None:
        gpu = cfg.num_gpus != 0 and torch.cuda.is_available()
        check_budget("--device-budget", device_text, cfg.device_budget,
                     *device_memory("cuda" if gpu else "cpu"))


@click.command()
@click.option("--loaders", type=int, required=True)
@click.option("--address", default="auto", show_default=True)
@click.option("--namespace", default="moestream", show_default=True)
def scale(loaders, address, namespace):
    """Run exactly N expert loaders (ownership re-shards; no request is lost)."""
    from services.app import connect

    names = connect(address, namespace).scale(loaders)
    click.echo(" ".join(names))


@click.command()
@click.option("--address", default="auto", show_default=True)
@click.option("--namespace", default="moestream", show_default=True)
def status(address, namespace):
    """Health and figures of every actor, as JSON."""
    from services.app import connect

    click.echo(json.dumps(connect(address, namespace).status(), indent=2, default=str))


@click.command()
@click.option("--address", default="auto", show_default=True)
@click.option("--namespace", default="moestream", show_default=True)
def shutdown(address, namespace):
    """Stop every actor of the deployment and free its shared memory."""
    from services.app import connect

    connect(address, namespace).shutdown()
    click.echo("stopped", err=True)


def generate_remote(address: str | None, prompt: str | None = None, *, chat: bool = False,
                    prompt_token_ids: list[int] | None = None, sampling: dict | None = None,
                    namespace: str = "moestream", out: TextIO | None = None,
                    err: TextIO | None = None, as_json: bool = False) -> Any:
    """What ``moestream generate --address ADDR`` runs: stream the text to ``out`` and end with
    one line of figures on ``err``; returns the GenerateResult (exit code 2 semantics are the
    caller's: an ErrorReply raises MoestreamError with the reply's message)."""
    from services.client import MoestreamClient

    out = out or sys.stdout
    err = err or sys.stderr
    client = MoestreamClient(address, namespace=namespace)
    kw: dict[str, Any] = {}
    if prompt_token_ids:
        kw["prompt_token_ids"] = list(prompt_token_ids)
    elif chat:
        kw["messages"] = [{"role": "user", "content": prompt}]
    else:
        kw["prompt"] = prompt
    result = stream_to(client.generate(sampling=sampling or {}, **kw), None if as_json else out)
    u = result.usage
    if as_json:
        out.write(result.model_dump_json() + "\n")
    else:
        out.write("\n")
    hit = f", expert hit rate {u.expert_hit_rate:.1%}" if u.expert_hit_rate is not None else ""
    err.write(f"[{result.finish_reason}] prompt {u.prompt_tokens} tok, generated "
              f"{u.completion_tokens} tok, decode {u.decode_tokens_per_s:.1f} tok/s{hit}\n")
    return result


class RemoteError(MoestreamError):
    """The deployment answered with an ErrorReply."""


def stream_to(messages, out: TextIO | None) -> Any:
    """Drain a client stream: write each chunk's text to ``out`` (None: write nothing), raise
    RemoteError for an ErrorReply, return the GenerateResult."""
    from protocol import ErrorReply, GenerateResult, TokenChunk

    result = None
    for msg in messages:
        if isinstance(msg, TokenChunk) and out is not None:
            out.write(msg.text)
            out.flush()
        elif isinstance(msg, ErrorReply):
            raise RemoteError(f"[{msg.code}] {msg.message}")
        elif isinstance(msg, GenerateResult):
            result = msg
    if result is None:
        raise RemoteError("the stream ended without a result")
    return result


@click.command("generate")
@click.argument("prompt", required=False)
@click.option("--address", default="auto", show_default=True)
@click.option("--namespace", default="moestream", show_default=True)
@click.option("--chat/--no-chat", default=False)
@click.option("--prompt-ids", default=None, help="Comma-separated token ids instead of text.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--json", "as_json", is_flag=True, help="Print the GenerateResult as JSON.")
def generate_cmd(prompt, address, namespace, chat, prompt_ids, max_tokens, temperature, seed, as_json):
    """Generate through a running deployment (what `moestream generate --address` does)."""
    with one_line_errors():
        ids = _token_ids(prompt_ids) if prompt_ids else None
        if prompt is None and ids is None:
            _fail("give a PROMPT or --prompt-ids")
        generate_remote(address, check_utf8(prompt, "PROMPT"), chat=chat, prompt_token_ids=ids,
                        namespace=namespace, sampling={"max_tokens": max_tokens,
                                                       "temperature": temperature, "seed": seed},
                        as_json=as_json)


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise ConfigError(f"--prompt-ids {text[:64]!r}: expected comma-separated integers "
                          f"like 1,15043,3186") from None


COMMANDS: list[Callable] = [serve, scale, status, shutdown]


@click.group()
def main() -> None:
    """moestream serving commands (also registered on the main `moestream` CLI)."""


for _c in (*COMMANDS, generate_cmd):
    main.add_command(_c)

if __name__ == "__main__":
    main()
