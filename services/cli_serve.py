"""``moestream serve | scale | status | shutdown`` and ``generate_remote`` (``generate --address``).

    moestream serve store/ --loaders 2           # local cluster; budgets auto (printed)
    moestream serve store/ --ram-budget 8GiB --device-budget 25%   # given budgets
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
from services.handles import NAMESPACE

STOP_GRACE_S = 10.0  # what a stop of `serve` lets requests in flight run for (--stop-grace)


@click.command()
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.option("--address", default=None, help="Join this cluster ('auto', HOST:6379); default: "
              "start a local cluster that lives as long as this command.")
@click.option("--namespace", default=NAMESPACE, show_default=True)
@click.option("--loaders", type=int, default=2, show_default=True)
@click.option("--device-budget", default="auto", show_default=True,
              help="Device expert slots: bytes (16GiB), a share of the store's experts (25%), or auto: "
              "the decode device's free memory less the dense weights, the KV budget and a workspace.")
@click.option("--ram-budget", default="auto", show_default=True,
              help="RAM tier, all loaders together: bytes, a share of the store's experts, or auto: the "
              "decode node's available RAM less a 4 GiB headroom (on a CPU shared with the device tier).")
@click.option("--kv-budget", default="256MiB", show_default=True)
@click.option("--ple-budget", default="256MiB", show_default=True,
              help="RAM row cache of a qwen4_exp store's PLE n-gram tables (read from disk on demand).")
@click.option("--policy", default="sweep", show_default=True)
@click.option("--admission/--no-admission", default=False, show_default=True,
              help="Admission control in the device cache (sweep): declined misses run from "
                   "staging slots instead of evicting.")
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
@click.option("--http", "http_address", default=None, metavar="HOST:PORT",
              help="Also serve the OpenAI-compatible HTTP API here (e.g. 127.0.0.1:8000), from "
              "a detached actor that outlives this command; binds loopback unless told otherwise.")
@click.option("--api-key", envvar="MOESTREAM_API_KEY", default=None,
              help="Bearer key the HTTP API requires on every endpoint but /health "
              "(env MOESTREAM_API_KEY); required when --http binds beyond loopback.")
@click.option("--served-model-name", default=None,
              help="Model id of the HTTP API (default: the store directory's name).")
@click.option("--max-waiting", type=int, default=None,
              help="Requests that may wait beyond the running batch; one more is refused "
              "(HTTP 429 with Retry-After). Default: only --queue-size bounds them.")
@click.option("--speculative", default=None, metavar="ngram|self|draft:PATH",
              help="Lossless speculative decoding for every request that does not opt out "
              "(per-request extra field speculative=false): prompt-lookup n-grams, the target on "
              "its device-resident experts, or a draft model sharing the tokenizer.")
@click.option("--max-draft", type=int, default=8, show_default=True,
              help="Most draft tokens verified per request and step (1..16).")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Reuse the KV blocks (and, on hybrid models, state snapshots) of prompt "
              "prefixes across requests; --no-prefix-cache prefills every prompt in full.")
@click.option("--stop-grace", type=click.FloatRange(0, 3600), default=STOP_GRACE_S, show_default=True,
              help="Local cluster: seconds a stop (SIGTERM, SIGINT, SIGHUP) lets requests in flight "
              "finish before aborting them and stopping the actors and the cluster.")
@click.option("--dense", "dense_format", type=click.Choice(["auto", "fp32", "bf16", "int8"]), default="auto",
              show_default=True, help="Format of the dense (attention, shared-expert, LM-head) linears on "
              "the decode actor; auto: int8 on a CPU with AVX512-VNNI, else bf16 "
              "(docs/quantization.md#the-default-dense-format).")
@click.option("--head", "head_format", type=click.Choice(["fp32", "bf16", "int8", "int4"]), default=None,
              help="Format of the LM head alone (default: as --dense).")
@click.option("--tool-call-parser", default=None,
              type=click.Choice(["hermes", "qwen3_coder", "deepseek_v3", "harmony"]),
              help="The model's tool-call syntax; default: read from its chat template "
              "(docs/agents.md).")
def serve(store, address, namespace, loaders, device_budget, ram_budget, kv_budget, ple_budget, policy,
          admission, prefetch_depth, queue_size, request_timeout, dtype, dashboard, num_cpus,
          object_store_memory, compute_threads, io_threads, http_address=None, api_key=None,
          served_model_name=None, max_waiting=None, speculative=None, max_draft=8, prefix_cache=True,
          stop_grace=None, dense_format="auto", head_format=None, tool_call_parser=None):
    """Deploy the pipeline (router, decode, N loaders) for STORE."""
    from pydantic import ValidationError

    from services.app import deploy
    from services.config import DeployConfig

    from engine.store.reader import ExpertStore

    with one_line_errors():  # opened once in this process, when a budget is a share of it
        opened = ExpertStore(store) if any(map(_is_share, (device_budget, ram_budget))) else None
    try:
        with one_line_errors():
            dev, ram = (share_of_experts(opened, text, option) for text, option in
                        ((device_budget, "--device-budget"), (ram_budget, "--ram-budget")))
        try:
            cfg = DeployConfig(store=store, address=address, namespace=namespace, loaders=loaders,
                               device_budget=dev, ram_budget=ram, kv_budget=kv_budget, ple_budget=ple_budget,
                               policy=policy, admission=admission, prefetch_depth=prefetch_depth,
                               queue_size=queue_size, request_timeout_s=request_timeout, dtype=dtype,
                               include_dashboard=dashboard, num_cpus=num_cpus,
                               object_store_memory=object_store_memory, compute_threads=compute_threads,
                               io_threads=io_threads, max_waiting=max_waiting,
                               speculative=speculative, max_draft=max_draft,
                               prefix_cache=prefix_cache, tool_call_parser=tool_call_parser,
                               dense_format=dense_format, head_format=head_format)
        except ValidationError as e:
            _fail("; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()))
        http = http_settings(http_address, api_key, served_model_name or cfg.store.name, namespace) \
            if http_address is not None else None
        with one_line_errors():  # a budget that cannot be met: one line, no actor left running
            if address is None:  # a local cluster: the budgets must fit this machine
                check_local_budgets(cfg, device_budget, ram_budget)
            app = deploy(cfg, store=opened)
    finally:
        if opened is not None:
            opened.close()
    status_now = app.status()
    if status_now["budgets"]["line"]:
        click.echo(status_now["budgets"]["line"], err=True)
    if http is not None:
        host, port = app.start_http(http)
        click.echo(f"OpenAI-compatible API on http://{host}:{port}/v1 (model "
                   f"{http.model_name!r}{', bearer key required' if http.api_key_sha256 else ''})",
                   err=True)
    click.echo(json.dumps(status_now, indent=2, default=str))
    if app.owns_cluster:  # the cluster dies with this process: serve until interrupted
        import ray

        from services.ray_env import forget_serve, record_serve

        jobs = ray._private.worker.global_worker.node.webui_url if dashboard else None
        record = record_serve(ray.get_runtime_context().gcs_address,
                              f"http://{jobs}" if jobs else None, namespace)
        click.echo("serving on a local cluster; Ctrl-C stops it", err=True)
        try:
            stop_on_signal(app, grace_s=STOP_GRACE_S if stop_grace is None else stop_grace)
        finally:
            forget_serve(record)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def stop_on_signal(app, poll_s: float = 0.5, grace_s: float = STOP_GRACE_S) -> float:
    """Serve until SIGTERM, SIGINT (Ctrl-C) or SIGHUP, to this process or its whole group (the
    local cluster runs in a session of its own: services/app.cluster_in_own_session), then let
    the requests in flight finish for up to ``grace_s``, abort the rest, stop every actor, free
    the shared memory and the local cluster; further signals are ignored until that is done
    (tests/services/test_serve_lifecycle.py). Returns the seconds the stop took."""
    import time

    stop = threading.Event()
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: stop.set())
    while not stop.wait(poll_s):  # a timed wait: the handler runs between waits
        pass
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    t0 = time.monotonic()
    left = app.drain(grace_s)
    if left > 0:
        click.echo(f"stopping: {left} request(s) still in flight after {grace_s:g} s: aborted",
                   err=True)
    app.shutdown()
    took = time.monotonic() - t0
    click.echo(f"stopped: actors, shared memory and the local cluster in {took:.1f} s", err=True)
    return took


def http_settings(address: str, api_key: str | None, model_name: str, namespace: str):
    """``--http HOST:PORT`` (or ``:PORT`` / ``PORT``: loopback) -> HttpSettings. A bind beyond
    loopback needs an API key."""
    from services.http.server import LOOPBACK, HttpSettings, key_digest

    host, sep, port = address.rpartition(":")
    if not sep:
        host, port = "", address
    host = host.strip("[]") or "127.0.0.1"
    try:
        port_n = int(port)
    except ValueError:
        port_n = -1
    if not 0 <= port_n <= 65535:
        _fail(f"--http {address!r}: expected HOST:PORT with a port in 0..65535, e.g. 127.0.0.1:8000")
    if api_key is not None and not api_key.strip():
        _fail("--api-key / MOESTREAM_API_KEY is empty; give a key or unset it")
    if host not in LOOPBACK and not api_key:
        _fail(f"--http {address!r} binds beyond loopback: give --api-key (or MOESTREAM_API_KEY)")
    return HttpSettings(host=host, port=port_n, namespace=namespace, model_name=model_name,
                        api_key_sha256=key_digest(api_key.strip()) if api_key else None)


def _is_share(text: object) -> bool:
    return isinstance(text, str) and text.strip().endswith("%")


def share_of_experts(store, text: str | None, option: str) -> str | int | None:
    """A budget ``N%`` -> bytes of the store's experts (``store``: an open ExpertStore or its
    directory); 'auto', sizes and None pass through (DeployConfig reads them)."""
    if not _is_share(text):
        return text
    from engine.experts.runtime import store_expert_bytes
    from engine.units import parse_bytes

    return parse_bytes(text, total=store_expert_bytes(store), name=option)


def check_local_budgets(cfg, device_text: object, ram_text: object) -> None:
    """Refuse, before any actor starts, given budgets larger than this machine (a local
    cluster); budgets auto fit it by construction (services/budgets.py)."""
    import torch

    if isinstance(cfg.ram_budget, int):
        check_budget("--ram-budget", ram_text, cfg.ram_budget, host_memory(), "RAM")
    if isinstance(cfg.device_budget, int):
        gpu = cfg.num_gpus != 0 and torch.cuda.is_available()
        check_budget("--device-budget", device_text, cfg.device_budget,
                     *device_memory("cuda" if gpu else "cpu"))


@click.command()
@click.option("--loaders", type=int, required=True)
@click.option("--address", default="auto", show_default=True)
@click.option("--namespace", default=NAMESPACE, show_default=True)
def scale(loaders, address, namespace):
    """Run exactly N expert loaders (ownership re-shards; no request is lost)."""
    from services.app import connect

    names = connect(address, namespace).scale(loaders)
    click.echo(" ".join(names))


@click.command()
@click.option("--address", default="auto", show_default=True)
@click.option("--namespace", default=NAMESPACE, show_default=True)
def status(address, namespace):
    """Health and figures of every actor, as JSON."""
    from services.app import connect

    click.echo(json.dumps(connect(address, namespace).status(), indent=2, default=str))


@click.command()
@click.option("--address", default="auto", show_default=True)
@click.option("--namespace", default=NAMESPACE, show_default=True)
def shutdown(address, namespace):
    """Stop every actor of the deployment and free its shared memory."""
    from services.app import connect

    connect(address, namespace).shutdown()
    click.echo("stopped", err=True)


def generate_remote(address: str | None, prompt: str | None = None, *, chat: bool = False,
                    prompt_token_ids: list[int] | None = None, sampling: dict | None = None,
                    namespace: str = NAMESPACE, out: TextIO | None = None,
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
@click.option("--namespace", default=NAMESPACE, show_default=True)
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


@click.command("env")
def env_cmd():
    """Print the environment Ray's own CLI needs for this account's running cluster (token auth,
    temp dir, loopback, its addresses): eval "$(moestream env)"; then `ray job submit ...` works.
    The cluster is the one a plain `moestream serve` started, else deploy/start-head.sh's; with
    none running no address is printed (and a note says so on stderr)."""
    from services.ray_env import cli_env, running_cluster, shell_exports

    cluster = running_cluster()
    click.echo(shell_exports(cli_env(cluster)), nl=False)
    if cluster is None:
        click.echo("# no Ray cluster of this account is running (neither a `moestream serve` nor "
                   "deploy/start-head.sh): RAY_ADDRESS is not set", err=True)
    else:
        jobs = f"Jobs API {cluster['jobs']}" if cluster["jobs"] else "no Jobs API (serve --dashboard starts it)"
        click.echo(f"# the cluster of {cluster['by']}: GCS {cluster['gcs']}, {jobs}", err=True)


COMMANDS.append(env_cmd)


@click.group()
def main() -> None:
    """moestream serving commands (also registered on the main `moestream` CLI)."""


for _c in (*COMMANDS, generate_cmd):
    main.add_command(_c)

if __name__ == "__main__":
    main()
