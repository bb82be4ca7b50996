"""The pipeline on a real local Ray cluster (one per session): greedy tokens through the actors
equal the in-process engine's; bad frames and requests get clear errors and the services stay
up; BUSY when full; cancellation frees KV blocks and expert pins; a killed loader and scaling
loaders mid-generation change no token."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import msgpack
import pytest

from protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    TokenChunk,
    encode,
)

pytestmark = pytest.mark.ray

GREEDY = {"temperature": 0.0, "max_tokens": 16}


@pytest.fixture(scope="module")
def client(app):
    from services.client import MoestreamClient

    return MoestreamClient(namespace=app.namespace)


def run(client, **kw):
    msgs = list(client.generate(**kw))
    assert msgs, kw
    return msgs


def result_of(msgs) -> GenerateResult:
    errors = [m for m in msgs if isinstance(m, ErrorReply)]
    assert not errors, errors
    assert isinstance(msgs[-1], GenerateResult), msgs[-1]
    return msgs[-1]


def wait_idle(app, timeout=30.0):
    import ray

    deadline = time.time() + timeout
    while True:
        s = ray.get(app.decode.stats.remote())
        if (s["kv_blocks_used"], s["expert_pins"], s["running"], s["waiting"]) == (0, 0, 0, 0) \
                or time.time() > deadline:
            return s
        time.sleep(0.1)


def assert_healthy(app):
    h = app.health()
    assert all(v.get("ok") for v in h.values()), h


def test_decode_actor_takes_the_cores_and_its_configured_io_threads(app, deploy_config):
    import os

    d = app.health()["decode"]["detail"]
    assert d["compute_threads"] == (deploy_config.compute_threads or os.cpu_count())  # not Ray's 1
    assert d["io_threads"] == deploy_config.io_threads


def test_driver_path_matches_in_process_engine(app, client, reference, store_path):
    prompt = [5, 17, 33, 8, 61, 12, 40, 3, 27]
    want = reference(prompt, 16)
    # plain decoding here: the byte bound below is per decode step
    msgs = run(client, prompt_token_ids=prompt, sampling={**GREEDY, "speculative": False})
    res = result_of(msgs)
    assert res.token_ids == want
    chunks = [m for m in msgs if isinstance(m, TokenChunk)]
    assert [t for c in chunks for t in c.token_ids] == want  # streamed == final
    assert "".join(c.text for c in chunks) == res.text
    u = res.usage
    assert u.prompt_tokens == len(prompt) and u.completion_tokens == len(want)
    # a device cache of top_k slots: each layer's pair of experts evicts the previous layer's,
    # so every lookup misses (in process, same store and prompt: 0 hits, 103 misses) and each
    # decode step moves 3 layers x 2 experts
    from engine.store import ExpertStore

    with ExpertStore(store_path) as st:
        nbytes, layers, top_k = st.expert_nbytes, len(st.config.moe_layers), st.config.moe.top_k
    assert u.expert_hit_rate == 0.0
    assert u.expert_bytes_per_token >= (len(want) - 1) * layers * top_k * nbytes / len(want)

    # text and chat go through the router's tokenizer and template
    tok = reference.tokenizer
    text = "the capital of france is"
    res = result_of(run(client, prompt=text, sampling=GREEDY, stream=False))
    assert res.token_ids == reference(tok.encode(text), 16)
    assert res.text == reference.text(tok.encode(text), 16)
    msgs = [{"role": "user", "content": "hello world"}]
    res = result_of(run(client, messages=msgs, sampling=GREEDY))
    assert res.token_ids == reference(tok.apply_chat_template(msgs), 16)
    s = wait_idle(app)
    assert s["kv_blocks_used"] == 0 and s["expert_pins"] == 0


def test_speculative_batch_of_8_matches_each_request_alone(app, client, reference):
    """8 concurrent requests on a server started with --speculative ngram (the test deployment):
    each gives its plain greedy tokens alone; usage reports drafts and acceptances; a request
    that opts out reports none."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [([7 + i, 20, 31, 7 + i, 20, 31, 44] * 3)[: 9 + 2 * i] for i in range(8)]
    want = [reference(p, 20) for p in prompts]

    def one(i):
        sampling = {"temperature": 0.0, "max_tokens": 20, "speculative": i != 7}
        return result_of(run(client, prompt_token_ids=prompts[i], sampling=sampling))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert [r.token_ids for r in results] == want
    usage = [r.usage for r in results]
    assert all(u.draft_tokens is not None and u.accepted_draft_tokens <= u.draft_tokens for u in usage[:7])
    assert sum(u.draft_tokens for u in usage[:7]) > 0 and sum(u.accepted_draft_tokens for u in usage[:7]) > 0
    assert usage[7].draft_tokens is None and usage[7].accepted_draft_tokens is None
    s = wait_idle(app)
    assert s["kv_blocks_used"] == 0 and s["expert_pins"] == 0


def test_stop_strings_are_matched_by_the_router(app, client, reference, store_path):
    """The decode actor computes tokens only; the router makes the text and cuts at a stop
    string, aborts the rest, and bills the tokens the client got: the same tokens, text and
    finish as the in-process engine with the stop string."""
    from engine.experts.runtime import load_from_store
    from engine.generate import Request
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine
    from tests.services.conftest import DENSE

    prompt = reference.tokenizer.encode("the capital of france is")
    free = reference.text(prompt, 24)
    stop = free[len(free) // 2: len(free) // 2 + 2]
    with load_from_store(store_path, dense=DENSE) as sm:
        engine = Engine.for_requests(sm.model, sm.tokenizer, len(prompt) + 24)
        want = engine.generate([Request(prompt, SamplingConfig(max_tokens=24, stop=(stop,)))])[0]
    for stream in (True, False):
        msgs = run(client, prompt_token_ids=prompt, stream=stream,
                   sampling={"temperature": 0.0, "max_tokens": 24, "stop": [stop]})
        res = result_of(msgs)
        assert (res.token_ids, res.text, res.finish_reason) == (want.output_ids, want.text, "stop")
        assert res.usage.completion_tokens == len(want.output_ids) < 24
        if stream:
            chunks = [m for m in msgs if isinstance(m, TokenChunk)]
            assert "".join(c.text for c in chunks) == want.text
            assert [t for c in chunks for t in c.token_ids] == want.output_ids
    s = wait_idle(app)
    assert s["kv_blocks_used"] == 0 and s["expert_pins"] == 0


# --------------------------------------------------------------------------- bad input


def _frames(body: dict, v: int = PROTOCOL_VERSION, type_: str = "generate_request") -> list:
    return [msgpack.packb({"v": v, "type": type_, "body": body, "buffers": []})]


def _only_error(client, frames) -> ErrorReply:
    msgs = list(client.submit_frames(frames))
    assert len(msgs) == 1 and isinstance(msgs[0], ErrorReply), msgs
    return msgs[0]


def test_bad_frames_and_requests_get_clear_errors_and_services_stay_up(app, client):
    ok = {"request_id": "bad-1", "prompt_token_ids": [5, 6, 7]}
    cases = [
        ([b"\xc1not msgpack"], ErrorCode.PROTOCOL, "not valid msgpack"),
        ([b""], ErrorCode.PROTOCOL, ""),
        ([msgpack.packb([1, 2, 3])], ErrorCode.PROTOCOL, "must be a msgpack map"),
        (_frames({**ok, "prompt": "a" * (17 << 20), "prompt_token_ids": None}),
         ErrorCode.PROTOCOL, "limit"),
        (_frames(ok, v=2), ErrorCode.PROTOCOL, "unsupported protocol version 2"),
        (_frames(ok, type_="launch_missiles"), ErrorCode.PROTOCOL, "unknown message type"),
        (_frames({**ok, "protocol_version": 7}), ErrorCode.PROTOCOL, "protocol_version"),
        (_frames({"request_id": "bad-2", "prompt": ""}), ErrorCode.INVALID_REQUEST, "prompt"),
        (_frames({**ok, "sampling": {"temperature": float("nan")}}), ErrorCode.INVALID_REQUEST,
         "temperature"),
        (_frames({**ok, "sampling": {"top_p": 0.0}}), ErrorCode.INVALID_REQUEST, "top_p"),
        (_frames({**ok, "sampling": {"max_tokens": 0}}), ErrorCode.INVALID_REQUEST, "max_tokens"),
        (_frames({**ok, "sampling": {"n": 10**6}}), ErrorCode.INVALID_REQUEST, "n"),
        (_frames({**ok, "sampling": {"stop": ["x"] * 100_000}}), ErrorCode.INVALID_REQUEST, "stop"),
        (_frames({**ok, "prompt_token_ids": [-1]}), ErrorCode.INVALID_REQUEST, "prompt_token_ids"),
        (_frames({**ok, "surprise": 1}), ErrorCode.INVALID_REQUEST, "surprise"),
        # checked past the wire: the router (n) and the engine (vocabulary, context)
        (_frames({**ok, "sampling": {"n": 2}}), ErrorCode.INVALID_REQUEST, "n=2"),
        (_frames({**ok, "prompt_token_ids": [5, 96]}), ErrorCode.INVALID_REQUEST, "out of range"),
        (_frames({**ok, "sampling": {"max_tokens": 300}}), ErrorCode.INVALID_REQUEST, "context"),
    ]
    for frames, code, words in cases:
        err = _only_error(client, frames)
        assert err.code == code, (words, err)
        assert words in err.message, (words, err.message)
    # a typed request through the Python API, invalid at the engine
    err = _only_error(client, encode(GenerateRequest(request_id="bad-3", prompt_token_ids=[200])))
    assert err.code == ErrorCode.INVALID_REQUEST and err.request_id == "bad-3"
    assert_healthy(app)
    res = result_of(run(client, prompt_token_ids=[5, 6, 7], sampling=GREEDY))
    assert res.finish_reason in ("stop", "length")
    assert wait_idle(app)["kv_blocks_used"] == 0


def test_queue_full_answers_busy(app, ray_cluster, deploy_config, reference):
    import ray

    from services.client import MoestreamClient
    from services.tokenizer_router import TokenizerRouter

    cfg = deploy_config.model_copy(update={"queue_size": 1})
    router = ray.remote(TokenizerRouter).options(num_cpus=0, namespace=app.namespace).remote(
        cfg.model_dump_json())
    try:
        c = MoestreamClient(namespace=app.namespace)
        c.router = router
        first = c.generate(prompt_token_ids=reference.long_prompt, request_id="busy-1",
                           sampling={"temperature": 0, "max_tokens": 100})
        assert isinstance(next(first), TokenChunk)  # admitted and running
        msgs = list(c.generate(prompt_token_ids=[5, 6], request_id="busy-2", sampling=GREEDY))
        assert len(msgs) == 1 and msgs[0].code == ErrorCode.BUSY and msgs[0].retryable
        assert "retry later" in msgs[0].message
        first.close()  # cancels busy-1
    finally:
        ray.kill(router)
    s = wait_idle(app)
    assert s["kv_blocks_used"] == 0 and s["expert_pins"] == 0


def test_concurrent_streams_get_their_own_tokens_in_one_frame_per_step(app, client, reference):
    """16 streams at once: each gets exactly its own tokens, in order, equal to the engine's
    alone; the decode actor sends the router one StepFrame per engine step for all of them
    (per-request streams sent one Ray item per request per step: ~16x more)."""
    import ray
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[(5 * i + 13 * k) % 90 + 4 for k in range(3 + i % 6)] for i in range(16)]
    want = [reference(p, 12) for p in prompts]
    r0, d0 = ray.get(app.router.stats.remote()), ray.get(app.decode.stats.remote())

    def one(i):
        msgs = run(client, prompt_token_ids=prompts[i], request_id=f"many-{i}",
                   sampling={"temperature": 0.0, "max_tokens": 12, "speculative": False})
        streamed = [t for m in msgs if isinstance(m, TokenChunk) for t in m.token_ids]
        return streamed, result_of(msgs).token_ids

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    assert got == [(w, w) for w in want]
    r1, d1 = ray.get(app.router.stats.remote()), ray.get(app.decode.stats.remote())
    frames, steps = r1["decode_frames"] - r0["decode_frames"], d1["steps"] - d0["steps"]
    assert frames == d1["step_frames"] - d0["step_frames"]  # nothing lost on the way
    assert 1 <= frames <= steps, (frames, steps)
    # a TokenChunk per token (no speculation: one token per step) and a GenerateResult each
    assert r1["decode_messages"] - r0["decode_messages"] == sum(len(w) for w in want) + 16


# --------------------------------------------------------------------------- cancellation


def test_cancel_and_disconnect_free_kv_blocks_and_pins(app, client, reference):
    # explicit cancel: the stream ends with finish_reason "abort"
    stream = client.generate(prompt_token_ids=reference.long_prompt, request_id="cancel-1",
                             sampling={"temperature": 0, "max_tokens": 100})
    got = [next(stream), next(stream)]
    assert all(isinstance(m, TokenChunk) for m in got)
    assert client.cancel("cancel-1")
    rest = list(stream)
    assert isinstance(rest[-1], GenerateResult) and rest[-1].finish_reason == "abort"
    assert len(rest[-1].token_ids) < 100
    s = wait_idle(app)
    assert s["kv_blocks_used"] == 0 and s["expert_pins"] == 0 and s["kv_sequences"] == 0

    # the client walks away mid-stream: closing the iterator aborts the request
    stream = client.generate(prompt_token_ids=reference.long_prompt, request_id="cancel-2",
                             sampling={"temperature": 0, "max_tokens": 100})
    next(stream)
    stream.close()
    s = wait_idle(app)
    assert s["kv_blocks_used"] == 0 and s["expert_pins"] == 0 and s["kv_sequences"] == 0
    assert_healthy(app)


# --------------------------------------------------------------------------- faults and scaling


def _loader_pid(app, name):
    import ray

    from protocol import decode

    h = ray.get_actor(name, namespace=app.namespace)
    return decode(ray.get(h.health.remote(), timeout=60))[0].detail["pid"]


def test_loader_killed_mid_generation_restarts_and_tokens_are_identical(app, client, reference):
    import ray

    prompt = reference.long_prompt
    want = reference(prompt, 60)
    ray.get(app.decode.set_direct_reads.remote(False))  # every device miss asks a loader
    try:
        pid0 = _loader_pid(app, "loader-0")
        stream = client.generate(prompt_token_ids=prompt, request_id="kill-1",
                                 sampling={"temperature": 0, "max_tokens": 60})
        msgs = [next(stream), next(stream)]
        ray.kill(ray.get_actor("loader-0", namespace=app.namespace), no_restart=False)
        msgs += list(stream)
        res = result_of(msgs)
        assert res.token_ids == want
        assert _loader_pid(app, "loader-0") != pid0  # it was restarted
        src = ray.get(app.decode.stats.remote())["source"]
        assert src["fetch_calls"] > 0
        print("kill test: decode-side fetch figures", src)
    finally:
        ray.get(app.decode.set_direct_reads.remote(True))
    assert_healthy(app)
    assert wait_idle(app)["kv_blocks_used"] == 0


def test_decode_killed_mid_stream_gives_engine_dead_then_serves_again(app, client, reference):
    """The router's one step stream from the decode actor fails with it: every request on it
    gets a typed engine_dead error (not a hang); once Ray has restarted the actor the next
    request opens a new stream and gets the engine's tokens."""
    import ray

    prompt = reference.long_prompt
    streams = [client.generate(prompt_token_ids=prompt, request_id=f"dkill-{i}",
                               sampling={"temperature": 0, "max_tokens": 100}) for i in range(3)]
    firsts = [next(s) for s in streams]
    assert all(isinstance(m, TokenChunk) for m in firsts)
    ray.kill(app.decode, no_restart=False)
    for s in streams:
        rest = list(s)
        errors = [m for m in rest if isinstance(m, ErrorReply)]
        assert errors and errors[0].code == ErrorCode.ENGINE_DEAD and errors[0].retryable, rest
    deadline = time.time() + 300
    while True:  # Ray restarts it: the store, the caches and the native step again
        try:
            ray.get(app.decode.check_health.remote(), timeout=60)
            break
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(1)
    res = result_of(run(client, prompt_token_ids=[5, 17, 33, 8], sampling=GREEDY))
    assert res.token_ids == reference([5, 17, 33, 8], 16)
    s = wait_idle(app)
    assert s["kv_blocks_used"] == 0 and s["running"] == 0
    assert_healthy(app)


def test_scale_loaders_1_3_1_during_generation_changes_no_token(app, client, reference):
    import ray

    from protocol import decode as decode_frames

    prompt = reference.long_prompt
    want = reference(prompt, 60)
    results, errors = [], []
    stop = threading.Event()
    running = threading.Event()

    def generate_forever():
        i = 0
        while not stop.is_set():
            try:
                stream = client.generate(prompt_token_ids=prompt, request_id=f"scale-{i}",
                                         sampling={"temperature": 0, "max_tokens": 60})
                msgs = [next(stream)]
                running.set()
                msgs += list(stream)
                results.append(result_of(msgs).token_ids)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
                return
            i += 1

    ray.get(app.decode.set_direct_reads.remote(False))
    t = threading.Thread(target=generate_forever, daemon=True)
    try:
        assert app.scale(1) == ["loader-0"]
        t.start()
        assert running.wait(60)
        assert app.scale(3) == ["loader-0", "loader-1", "loader-2"]
        time.sleep(0.5)
        served = {}
        for name in ("loader-1", "loader-2"):
            h = ray.get_actor(name, namespace=app.namespace)
            d = decode_frames(ray.get(h.health.remote(), timeout=60))[0].detail
            served[name] = d["ram_hits"] + d["ram_misses"]
        assert all(served.values()), served  # the new loaders own keys and serve them
        n_during = len(results)
        assert app.scale(1) == ["loader-0"]
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(120)
        ray.get(app.decode.set_direct_reads.remote(True))
        app.scale(2)
    assert not errors, errors
    assert results and all(r == want for r in results), (len(results), n_during)
    print("scale test: generations", len(results), "done before scale(1):", n_during, served)
    assert_healthy(app)
    assert wait_idle(app)["kv_blocks_used"] == 0


# --------------------------------------------------------------------------- other submission paths


def test_ray_client_path_matches_in_process_engine(app, ray_cluster, reference):
    """The Ray client (ray://) in a separate process: it cannot consume streaming generators,
    so the client reads its request's step stream by long poll (router.poll_steps)."""
    import json
    import os
    import subprocess
    import sys

    prompt = [5, 17, 33, 8, 61, 12, 40, 3, 27]
    code = (
        "import json, sys\n"
        "from services.client import MoestreamClient\n"
        f"c = MoestreamClient({ray_cluster['client']!r}, namespace={app.namespace!r})\n"
        "assert c.polling\n"
        f"msgs = list(c.generate(prompt_token_ids={prompt!r}, sampling={{'temperature': 0, 'max_tokens': 16}}))\n"
        "print('RESULT', json.dumps([m.model_dump(mode='json') for m in msgs]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stdout[-2000:] + out.stderr[-4000:]
    msgs = json.loads(line[0][7:])
    assert msgs[-1]["type"] == "generate_result", msgs[-1]
    assert msgs[-1]["token_ids"] == reference(prompt, 16)
    assert [t for m in msgs[:-1] for t in m["token_ids"]] == msgs[-1]["token_ids"]


@pytest.mark.slow
def test_job_submit_path_matches_in_process_engine(app, ray_cluster, reference):
    """`ray job submit -- python -m services.cli_serve generate --address auto ...` (what
    `moestream generate --address auto` runs); needs the dashboard, so it is marked slow."""
    import json
    import os
    import subprocess
    import sys

    prompt = [5, 17, 33, 8, 61, 12, 40, 3, 27]
    # Ray's CLI of this interpreter's environment: the README's test command runs without an
    # activated venv, so `ray` need not be on PATH
    ray_cli = str(Path(sys.executable).with_name("ray"))
    cmd = [ray_cli, "job", "submit", "--address", ray_cluster["dashboard"], "--",
           sys.executable, "-m", "services.cli_serve", "generate", "--address", "auto",
           "--namespace", app.namespace, "--prompt-ids", ",".join(map(str, prompt)),
           "--max-tokens", "16", "--json"]
    for attempt in range(10):  # Ray answers "No available agent ... try again later" until the
        # head's dashboard agent has registered, which takes a while on a loaded machine
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                             env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        if out.returncode == 0 or "No available agent" not in out.stdout + out.stderr:
            break
        time.sleep(10)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("{\"protocol_version\"")]
    assert line, out.stdout[-3000:]
    assert json.loads(line[-1])["token_ids"] == reference(prompt, 16)
