"""The decode -> router stream: one StepFrame per engine step for all of a subscriber's requests
(services/decode_stream.py), demultiplexed by the router into per-request streams
(services/step_mux.py).

The first tests drive StepStreams from a thread standing in for the engine loop (many steps,
many requests, several subscribers); the last one runs the real decode service and router in one
process (no Ray) and checks 16 concurrent streams against the engine alone."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import pytest

from protocol import ErrorCode, ErrorReply, GenerateResult, StepFrame, TokenChunk, Usage, decode
from services.decode_stream import Finished, StepStreams

USAGE = Usage(prompt_tokens=1, completion_tokens=0, prefill_tokens_per_s=0, decode_tokens_per_s=0)


def out(tokens, reason=None):
    """An engine RequestOutput's shape (the fields the stream reads)."""
    return SimpleNamespace(new_token_ids=list(tokens), new_text="", logprobs=None,
                           finish_reason=reason)


async def collect(streams: StepStreams, name: str, aborted: list, frames: list) -> None:
    async for f in streams.frames(streams.subscriber(name), aborted.append):
        frames.append(decode(f, expect=StepFrame)[0])


def run_engine(streams: StepStreams, sinks: dict, steps: int, step_done=None) -> None:
    """An engine-loop thread: every step gives each request one token, the last step finishes
    them, and each step ends with ONE flush (as EngineLoop does)."""
    for s in range(steps):
        for rid, sink in sinks.items():
            tok = [int(rid[1:]) * 1000 + s]
            sink(Finished(out(tok, "length"), USAGE) if s == steps - 1 else out(tok))
        streams.flush()
        if step_done is not None:
            step_done(s)


def test_one_frame_per_step_for_all_requests_each_getting_its_own_tokens_in_order():
    n_req, steps, subs = 64, 12, ("a", "b", "c")

    async def main():
        streams = StepStreams()
        frames = {s: [] for s in subs}
        aborted: list = []
        tasks = [asyncio.create_task(collect(streams, s, aborted, frames[s])) for s in subs]
        await asyncio.sleep(0)
        sinks = {f"r{i}": streams.open(streams.subscriber(subs[i % 3]), f"r{i}", 1, False)
                 for i in range(n_req)}
        loop = asyncio.get_running_loop()
        # the engine waits until the loop has sent the step (a real engine is slower than this)
        sent = [asyncio.Event() for _ in range(steps)]

        def step_done(s):
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0.01), loop).result()
            loop.call_soon_threadsafe(sent[s].set)

        await asyncio.to_thread(run_engine, streams, sinks, steps, step_done)
        await sent[-1].wait()
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return streams, frames, aborted

    streams, frames, aborted = asyncio.run(main())
    assert aborted == []  # every request had finished
    assert streams.requests == {} and streams.subscribers == {}
    for s, fs in frames.items():
        assert [f.seq for f in fs] == list(range(len(fs)))
        # one frame per step whatever the number of requests (64 here, 21-22 per subscriber)
        assert 1 <= len(fs) <= steps, (s, len(fs))
        got: dict[str, list] = {}
        for f in fs:
            for m in f.messages:
                got.setdefault(m.request_id, []).append(m)
        mine = {f"r{i}" for i in range(n_req) if subs[i % 3] == s}
        assert set(got) == mine
        for rid, msgs in got.items():
            want = [int(rid[1:]) * 1000 + k for k in range(steps)]
            assert [t for m in msgs if isinstance(m, TokenChunk) for t in m.token_ids] == want
            assert isinstance(msgs[-1], GenerateResult) and msgs[-1].token_ids == want
            assert msgs[-1].finish_reason == "length"
            assert sum(isinstance(m, GenerateResult) for m in msgs) == 1


def test_a_subscriber_going_away_aborts_its_running_requests_only():
    async def main():
        streams = StepStreams()
        aborted: list = []
        fa, fb = [], []
        ta = asyncio.create_task(collect(streams, "a", aborted, fa))
        tb = asyncio.create_task(collect(streams, "b", aborted, fb))
        await asyncio.sleep(0)
        sa = [streams.open(streams.subscriber("a"), f"a{i}", 1, False) for i in range(3)]
        sb = streams.open(streams.subscriber("b"), "b0", 1, False)
        sa[0](Finished(out([1], "stop"), USAGE))  # a0 is done before a goes away
        for sink in (*sa[1:], sb):
            sink(out([2]))
        streams.flush()
        await asyncio.sleep(0.05)
        ta.cancel()
        await asyncio.gather(ta, return_exceptions=True)
        assert sorted(aborted) == ["a1", "a2"]
        sa[1](Finished(out([], "abort"), USAGE))  # the engine's late answer: dropped
        sb(Finished(out([3], "stop"), USAGE))
        streams.flush()
        await asyncio.sleep(0.05)
        tb.cancel()
        await asyncio.gather(tb, return_exceptions=True)
        return streams, fa, fb, aborted

    streams, fa, fb, aborted = asyncio.run(main())
    assert sorted(aborted) == ["a1", "a2"] and streams.requests == {}
    msgs_b = [m for f in fb for m in f.messages]
    assert [type(m).__name__ for m in msgs_b] == ["TokenChunk", "TokenChunk", "GenerateResult"]
    assert msgs_b[-1].token_ids == [2, 3]


def test_refusals_and_failures_are_typed_error_replies_to_their_subscriber():
    async def main():
        streams = StepStreams()
        fa, fb, aborted = [], [], []
        ta = asyncio.create_task(collect(streams, "a", aborted, fa))
        tb = asyncio.create_task(collect(streams, "b", aborted, fb))
        await asyncio.sleep(0)
        a, b = streams.subscriber("a"), streams.subscriber("b")
        sink = streams.open(a, "x", 2, False)
        with pytest.raises(Exception, match="already in use") as ei:
            streams.open(b, "x", 2, False)
        streams.refuse(b, "x", ei.value)  # b's refusal does not touch a's request
        sink(out([7, 8]))
        sink(RuntimeError("expert load failed"))  # mid-stream: error, then the partial result
        streams.flush()
        await asyncio.sleep(0.05)
        for t in (ta, tb):
            t.cancel()
        await asyncio.gather(ta, tb, return_exceptions=True)
        return fa, fb

    fa, fb = asyncio.run(main())
    (b_err,) = [m for f in fb for m in f.messages]
    assert isinstance(b_err, ErrorReply) and b_err.code is ErrorCode.INVALID_REQUEST
    msgs = [m for f in fa for m in f.messages]
    assert [type(m).__name__ for m in msgs] == ["TokenChunk", "ErrorReply", "GenerateResult"]
    assert msgs[1].code is ErrorCode.INTERNAL and "expert load failed" in msgs[1].message
    assert msgs[2].finish_reason == "error" and msgs[2].token_ids == [7, 8]


async def one_request(router, subscriber: str, frames: list, *, polled: bool = False) -> list:
    """One request through the router's intake as the Python client sends it: ``submit`` into a
    subscriber of its own, then that subscriber's step stream until the request has ended, read
    as a stream (``steps(until_done=True)``) or by long poll (``poll_steps``, the Ray client's)."""
    refused = await router.submit(subscriber, frames)
    if refused is not None:
        return [decode(refused)[0]]
    raw = []
    if polled:
        done = False
        while not done:
            batch, done = await router.poll_steps(subscriber, 0.5)
            raw += batch
    else:
        raw = [f async for f in router.steps(subscriber, until_done=True)]
    frames_in = [decode(f, expect=StepFrame)[0] for f in raw]
    assert [f.seq for f in frames_in] == list(range(len(frames_in)))  # numbered without gaps
    assert subscriber not in router.outboxes  # the subscriber is gone with its request
    return [m for f in frames_in for m in f.messages]


@pytest.fixture(scope="module")
def local_pipeline(store_path):
    """The real DecodeService (a HostTier feeds its expert cache), TokenizerRouter and
    HttpService in one process and one event loop, talking through handle stand-ins."""
    from engine.experts.tiers import HostTier
    from engine.store.reader import ExpertStore
    from services.config import DeployConfig
    from services.decode import DecodeService
    from services.http.server import HttpService, HttpSettings
    from services.tokenizer_router import TokenizerRouter
    from tests.services.conftest import DENSE
    from tests.services.local_handles import Handle

    store = ExpertStore(store_path)
    cfg = DeployConfig(store=store_path, loaders=1, kv_budget="4MiB", prefetch_depth=0,
                       dense_format=DENSE, max_num_seqs=16, compute_threads=1)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def build():
        dec = DecodeService(cfg.model_dump_json(),
                            source=HostTier(store, store.num_experts_total * store.expert_nbytes * 2))
        router = TokenizerRouter(cfg.model_dump_json(), decode_handle=Handle(dec))
        http = HttpService(HttpSettings(host="127.0.0.1", port=0, model_name="m").model_dump_json(),
                           router=Handle(router), decode=Handle(dec), autostart=False)
        host, port = await http.start()
        return dec, router, http, f"http://{host}:{port}"

    dec, router, http, url = asyncio.run_coroutine_threadsafe(build(), loop).result(300)
    yield SimpleNamespace(loop=loop, dec=dec, router=router, http=http, url=url)
    asyncio.run_coroutine_threadsafe(http.close(), loop).result(30)
    asyncio.run_coroutine_threadsafe(router.close(), loop).result(30)
    asyncio.run_coroutine_threadsafe(dec.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    store.close()


def test_router_over_decode_16_streams_match_the_engine_alone_one_frame_per_step(
        local_pipeline, reference):
    from protocol import GenerateRequest, encode

    loop, dec, router = local_pipeline.loop, local_pipeline.dec, local_pipeline.router
    prompts = [[(7 * i + 11 * k) % 90 + 4 for k in range(4 + i % 5)] for i in range(16)]
    greedy = {"temperature": 0.0, "max_tokens": 12}

    async def one(i):
        req = GenerateRequest(request_id=f"s{i}", prompt_token_ids=prompts[i], stream=True,
                              sampling=greedy)
        ids, result = [], None
        for msg in await one_request(router, f"client-{i}", encode(req)):
            assert not isinstance(msg, ErrorReply), msg
            if isinstance(msg, TokenChunk):
                ids += msg.token_ids
            else:
                result = msg
        return ids, result

    async def run():
        steps0, frames0 = dec.loop.steps, dec.streams.frames_sent
        got = await asyncio.gather(*(one(i) for i in range(16)))
        return got, dec.loop.steps - steps0, dec.streams.frames_sent - frames0

    got, steps, frames = asyncio.run_coroutine_threadsafe(run(), loop).result(600)
    for i, (ids, result) in enumerate(got):
        want = reference(prompts[i], 12)
        assert ids == want and result.token_ids == want, i
    # 16 streams x ~12 tokens: per-request streams would have sent ~190 items
    assert 1 <= frames <= steps, (frames, steps)
    assert router.subscription.frames == frames


def test_an_output_that_cannot_be_sent_fails_its_own_request_only():
    async def main():
        streams = StepStreams()
        frames, aborted = [], []
        task = asyncio.create_task(collect(streams, "a", aborted, frames))
        await asyncio.sleep(0)
        a = streams.subscriber("a")
        bad, good = streams.open(a, "bad", 1, False), streams.open(a, "good", 1, False)
        nan = SimpleNamespace(new_token_ids=[4], new_text="", logprobs=[{"logprob": float("nan")}])
        bad(nan)  # TokenChunk refuses a NaN logprob
        good(out([5]))
        streams.flush()
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return frames, aborted, streams

    frames, aborted, streams = asyncio.run(main())
    msgs = [m for f in frames for m in f.messages]
    assert [(type(m).__name__, m.request_id) for m in msgs] == [("ErrorReply", "bad"),
                                                                 ("TokenChunk", "good")]
    assert msgs[0].code is ErrorCode.INVALID_REQUEST or msgs[0].code is ErrorCode.INTERNAL
    assert aborted == ["bad", "good"]  # bad at once; good when its subscriber went away


def test_http_streams_get_their_own_text_in_one_router_frame_per_step(local_pipeline, reference):
    """16 SSE streams through the HTTP actor: each gets the engine's text alone, and the
    router sends the HTTP actor one StepFrame per step for all of them."""
    import aiohttp

    p = local_pipeline
    prompts = [[(3 * i + 17 * k) % 90 + 4 for k in range(5 + i % 4)] for i in range(16)]

    async def one(session, i):
        body = {"model": "m", "prompt": prompts[i], "max_tokens": 10, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        text, usage, finish = "", None, None
        async with session.post(f"{p.url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    usage = obj["usage"]
                for c in obj["choices"]:
                    text += c["text"]
                    finish = c.get("finish_reason") or finish
        return text, usage, finish

    async def run():
        steps0, frames0 = p.dec.loop.steps, getattr(p.router.subscription, "frames", 0)
        async with aiohttp.ClientSession() as session:
            got = await asyncio.gather(*(one(session, i) for i in range(16)))
        return got, p.dec.loop.steps - steps0, p.http._steps, p.router.subscription.frames - frames0

    got, steps, sub, decode_frames = asyncio.run_coroutine_threadsafe(run(), p.loop).result(600)
    for i, (text, usage, finish) in enumerate(got):
        want = reference(prompts[i], 10)
        assert text == reference.text(prompts[i], 10), i
        assert usage["completion_tokens"] == len(want) and finish in ("stop", "length")
    # about one frame per step: the router turns a decode frame holding several steps into one
    # frame per step of tokens, and results' end marks may take a few more (requests end in
    # different steps; seen: 15 frames for 12 steps); one Ray item per message (the old
    # router.submit_frames per request) would be >= 16 x 11
    assert 1 <= sub.frames <= steps + 6, (sub.frames, steps, decode_frames)
    assert 1 <= decode_frames <= steps
    assert p.router.outboxes[sub.name].tasks == {}  # every request's task is done


def test_unreadable_request_frames_are_one_typed_reply_and_end_the_subscribers_stream(local_pipeline):
    """A hostile GenerateRequest (not msgpack; a request id of the wrong type) submitted into a
    step stream gets one ErrorReply, counted as a protocol error or an invalid request; nothing
    reaches the engine, and a client's stream waiting for its request ends (streamed or polled)
    instead of hanging."""
    from protocol import GenerateRequest, encode

    loop, dec, router = local_pipeline.loop, local_pipeline.dec, local_pipeline.router
    good = encode(GenerateRequest(request_id="ok", prompt_token_ids=[5, 6], sampling={"max_tokens": 1}))
    garbage = [good[0], b"\xc1not msgpack"] + list(good[2:])

    async def run():
        before, steps0 = dict(router.counts), dec.loop.steps
        stream = router.steps("hostile", until_done=True)
        first = asyncio.ensure_future(anext(stream, None))  # the stream waits before the submit
        await asyncio.sleep(0.05)
        refused = await router.submit("hostile", garbage)
        rest = await asyncio.wait_for(first, 10)
        polled = await router.submit("hostile-polled", garbage), await router.poll_steps("hostile-polled", 5)
        return before, decode(refused)[0], rest, polled, dec.loop.steps - steps0

    before, refused, rest, (refused2, polled), steps = \
        asyncio.run_coroutine_threadsafe(run(), loop).result(120)
    assert isinstance(refused, ErrorReply) and refused.code is decode(refused2)[0].code
    assert rest is None and polled == ([], True)  # both subscribers' streams are over, empty
    assert "hostile" not in router.outboxes and "hostile-polled" not in router.outboxes
    bumped = {k: router.counts[k] - before[k] for k in ("invalid", "protocol_errors")}
    assert sum(bumped.values()) == 2 and steps == 0


def test_a_polled_request_matches_the_streamed_one_and_stop_strings_bill_alike(local_pipeline, reference):
    """The long-poll read of a subscriber's step stream (the Ray client's) gives the messages
    the streamed read gives: same tokens, text, finish reason and billed tokens, with a stop
    string cutting both at the same place."""
    from protocol import GenerateRequest, encode

    loop, router = local_pipeline.loop, local_pipeline.router
    prompt = [9, 21, 33, 14, 5]
    text = reference.text(prompt, 12)
    stop = text[len(text) // 2:][:3]

    async def run():
        got = {}
        for polled in (False, True):
            for sampling in ({"temperature": 0, "max_tokens": 12},
                             {"temperature": 0, "max_tokens": 12, "stop": [stop]}):
                rid = f"p{int(polled)}-{len(sampling)}"
                req = GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
                got[polled, len(sampling)] = await one_request(router, f"c-{rid}", encode(req),
                                                               polled=polled)
        return got

    got = asyncio.run_coroutine_threadsafe(run(), loop).result(300)
    for kind in (2, 3):
        streamed, polled = got[False, kind], got[True, kind]
        assert [type(m).__name__ for m in streamed][-1] == "GenerateResult"
        strip = lambda ms: [m.model_dump(exclude={"request_id", "usage"}) for m in ms]  # noqa: E731
        assert strip(streamed) == strip(polled), kind
        assert streamed[-1].usage.completion_tokens == len(streamed[-1].token_ids)
    assert got[False, 2][-1].token_ids == reference(prompt, 12)
    cut = got[False, 3][-1]
    assert cut.finish_reason == "stop" and stop not in cut.text and len(cut.token_ids) < 12


def test_a_polled_subscriber_left_unread_is_dropped_and_its_request_aborted(local_pipeline, monkeypatch):
    """A Ray client gone mid-request stops polling: once its subscriber has been left unread
    for POLL_IDLE_S, the next submit or poll drops it and its request is aborted in the engine
    (KV freed), as a stream whose reader went away."""
    import services.tokenizer_router as tr
    from protocol import GenerateRequest, encode

    loop, dec, router = local_pipeline.loop, local_pipeline.dec, local_pipeline.router
    step = dec.engine.step

    def slow_step():  # >= 2.5 s for the 250 tokens: the request is still running when swept,
        time.sleep(0.01)  # however fast the machine (it finished first once with the int8 default)
        return step()

    monkeypatch.setattr(dec.engine, "step", slow_step)

    async def run():
        req = GenerateRequest(request_id="gone", prompt_token_ids=[4, 8, 15, 16],
                              sampling={"temperature": 0, "max_tokens": 250})
        # as long as the context (256) allows: on a loaded machine the engine thread could finish
        # a short request before this loop's turn comes to sweep it (seen once with 64 tokens)
        assert await router.submit("gone-client", encode(req)) is None
        task = router.outboxes["gone-client"].tasks["gone"]
        while router.subscription is None or "gone" not in router.subscription.queues:
            await asyncio.sleep(0.001)  # until it is in the engine (submitted to decode)
        monkeypatch.setattr(tr, "POLL_IDLE_S", 0.0)
        left = await router.poll_steps("someone-else", 0)  # any caller sweeps, before it waits
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(200):
            if dec.kv.metrics().num_sequences == 0:
                break
            await asyncio.sleep(0.05)
        return left, task.cancelled(), "gone" in router.active

    left, cancelled, still = asyncio.run_coroutine_threadsafe(run(), loop).result(120)
    assert left == ([], True) and cancelled and not still
    assert "gone-client" not in router.outboxes
    assert dec.kv.metrics().num_sequences == 0  # aborted in the engine: its KV freed
