"""gpt-oss's reasoning through the OpenAI API: chat answers carry the analysis channel as
``reasoning_content`` and the final channel as ``content`` (streaming: ``delta.*``), usage
unchanged, ``<|return|>``/``<|call|>`` end the request in the engine, completions stay plain text.

The router (services.tokenizer_router) reads a real int4 store of a tiny random gpt-oss with the
harmony test tokenizer; the decode actor is replaced by a scripted one (a random model does not
write harmony), so the exact split is checked through the real router, the real HTTP server
(services.http) and the official openai client, in one process. The last test serves the real
store on the session's Ray cluster (its own namespace) and checks the answer against the
in-process engine's greedy tokens parsed by the reference parser."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine.harmony import HarmonyTokens, split_reference
from protocol import Usage
from services.decode_stream import Finished, StepStreams
from tests.services.local_handles import InProcessServer
from tests.services.test_harmony import ANALYSIS, FINAL, SCRIPT

openai = pytest.importorskip("openai")
MODEL = "tiny-gpt-oss"
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"}]
TOOL_CALL = ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
             "{\"location\": \"Paris\"}<|call|>")


@pytest.fixture(scope="module")
def gpt_oss_store(tmp_path_factory):
    from engine.quant.formats import QuantFormat
    from engine.store import convert
    from tests.engine.models.test_gpt_oss import make_gpt_oss
    from tests.services.harmony_tiny import make_harmony_tokenizer

    d = tmp_path_factory.mktemp("gpt_oss_harmony")
    n = make_harmony_tokenizer(d / "hf")
    # <|return|> (6) is the end-of-sequence id, <|endoftext|> (0) the padding, as in gpt-oss
    make_gpt_oss(d / "hf", seed=15, vocab_size=n, eos_token_id=6, pad_token_id=0, bos_token_id=None)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


# --------------------------------------------------------------------------- in-process wiring


class ScriptedDecode:
    """The decode actor's interface (``submit`` + ``steps``: its step streams, the real
    services.decode_stream), writing a script's tokens 3 per step. Like the engine it stops
    after a token in ``sampling["stop_token_ids"]`` or its own end-of-sequence ids (here only
    <|return|>, as the tokenizer's eos), else at max_tokens or the script's end."""

    def __init__(self, eos: set[int]) -> None:
        self.eos = eos
        self.script: list[int] = []
        self.calls: list[tuple[list[int], dict]] = []
        self.aborted: list[str] = []
        self.streams = StepStreams()

    async def steps(self, subscriber):
        async for frame in self.streams.frames(self.streams.subscriber(subscriber), self.aborted.append):
            yield frame

    async def submit(self, subscriber, rid, prompt_ids, sampling):
        self.calls.append((list(prompt_ids), dict(sampling)))
        sink = self.streams.open(self.streams.subscriber(subscriber), rid, len(prompt_ids), False)
        asyncio.get_running_loop().create_task(self._play(sink, len(prompt_ids), sampling))

    async def _play(self, sink, n_prompt, sampling):
        stops = set(sampling["stop_token_ids"]) | self.eos
        out, reason = [], "length"
        for t in self.script[:sampling["max_tokens"]]:
            out.append(t)
            if t in stops:
                reason = "stop"
                break
        for k in range(0, len(out), 3):
            await asyncio.sleep(0)
            sink(SimpleNamespace(new_token_ids=out[k:k + 3], new_text="", logprobs=None))
            self.streams.flush()
        usage = Usage(prompt_tokens=n_prompt, completion_tokens=len(out),
                      prefill_tokens_per_s=1.0, decode_tokens_per_s=1.0)
        sink(Finished(SimpleNamespace(new_token_ids=[], new_text="", logprobs=None,
                                      finish_reason=reason), usage))
        self.streams.flush()

    async def abort(self, rid):
        self.aborted.append(rid)

    async def check_health(self):
        return None


@pytest.fixture(scope="module")
def served(gpt_oss_store):
    """(base url, tokenizer, scripted decode): router + HTTP server on a private event loop."""
    dec = ScriptedDecode(eos=set())
    with InProcessServer(gpt_oss_store, "harmony-inproc", MODEL, dec) as (url, router):
        yield url, router, dec


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0, timeout=60)


def _script(router, text: str, junk: str = " and then more text") -> list[int]:
    tok = router.tokenizer
    return tok.encode(text, add_special_tokens=False) + tok.encode(junk, add_special_tokens=False)


def test_router_knows_gpt_oss_writes_harmony(served):
    _, router, dec = served
    assert router.harmony == HarmonyTokens.from_tokenizer(router.tokenizer)
    # the tokenizer's own end-of-sequence is <|return|> only: <|call|> comes from the format
    assert router.tokenizer.eos_token_ids == {router.harmony.ret}
    assert router.harmony.stop_ids <= router.eos_ids


def test_chat_returns_reasoning_apart(served, client):
    _, router, dec = served
    tok, T = router.tokenizer, router.harmony
    dec.script = _script(router, SCRIPT)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0)
    prompt, sampling = dec.calls[-1]
    assert prompt == tok.apply_chat_template(MESSAGES)  # rendered by the harmony template
    assert set(sampling["stop_token_ids"]) >= {T.ret, T.call}
    msg = r.choices[0].message
    assert (msg.content, msg.model_extra["reasoning_content"]) == (FINAL, ANALYSIS)
    assert r.choices[0].finish_reason == "stop"
    n = dec.script.index(T.ret) + 1  # the tokens the model wrote, control tokens included
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(prompt), n, len(prompt) + n)


def test_streamed_chat_sends_reasoning_deltas_first(served, client):
    _, router, dec = served
    dec.script = _script(router, SCRIPT)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    kinds, content, reasoning = [], "", ""
    for c in chunks[1:]:
        if not c.choices:
            continue
        d = c.choices[0].delta
        r = (d.model_extra or {}).get("reasoning_content")
        if r:
            reasoning += r
            kinds.append("r")
        if d.content:
            content += d.content
            kinds.append("c")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (content, reasoning) == (FINAL, ANALYSIS)
    assert kinds == sorted(kinds, reverse=True) and kinds.count("r") > 3  # streamed, in order
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == dec.script.index(router.harmony.ret) + 1


def test_reasoning_effort_reaches_the_template(served, client):
    _, router, dec = served
    tok = router.tokenizer
    dec.script = _script(router, SCRIPT)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, reasoning_effort="high")
    prompt = dec.calls[-1][0]
    assert prompt == tok.apply_chat_template(MESSAGES, reasoning_effort="high")
    assert "Reasoning: high" in tok.decode(prompt) and prompt != tok.apply_chat_template(MESSAGES)
    n = len(dec.calls)
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       reasoning_effort="extreme")
    assert ei.value.body["param"] == "reasoning_effort" and len(dec.calls) == n


def test_an_answer_sent_back_with_its_reasoning_is_accepted(served, client):
    """Clients send earlier answers back as they came; the reasoning is not rendered."""
    _, router, dec = served
    dec.script = _script(router, SCRIPT)
    history = [*MESSAGES, {"role": "assistant", "content": FINAL, "reasoning_content": ANALYSIS},
               {"role": "user", "content": "And of Japan?"}]
    client.chat.completions.create(model=MODEL, messages=history, max_tokens=8)
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in history]
    assert dec.calls[-1][0] == router.tokenizer.apply_chat_template(plain)


def test_call_ends_the_request_in_the_engine(served, client):
    _, router, dec = served
    T = router.harmony
    dec.script = _script(router, TOOL_CALL)
    assert T.call not in dec.eos  # only the router's stop ids can stop the scripted engine there
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == dec.script.index(T.call) + 1
    assert r.choices[0].message.content == "{\"location\": \"Paris\"}"
    assert r.choices[0].message.model_extra["reasoning_content"] == ""


def test_stop_string_and_max_tokens_mid_reasoning(served, client):
    _, router, dec = served
    tok, T = router.tokenizer, router.harmony
    dec.script = _script(router, SCRIPT)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, stop=["naïve"])
    assert (r.choices[0].message.content, r.choices[0].message.model_extra["reasoning_content"]) == (
        "Paris, ", ANALYSIS)
    assert r.choices[0].finish_reason == "stop"
    # cut inside the reasoning by max_tokens: reasoning so far, no answer
    k = dec.script.index(T.end) - 4
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=k)
    want = split_reference(tok, T, dec.script[:k])
    assert want.reasoning and not want.content
    assert (r.choices[0].message.content, r.choices[0].message.model_extra["reasoning_content"]) == (
        "", want.reasoning)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == k


def test_completions_stay_plain_text(served, client):
    _, router, dec = served
    tok, T = router.tokenizer, router.harmony
    dec.script = _script(router, SCRIPT)
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=200)
    n = dec.script.index(T.ret)
    assert r.choices[0].text == tok.decode(dec.script[:n])  # control tokens skipped, no split
    assert "reasoning_content" not in (r.choices[0].model_extra or {})
    assert r.usage.completion_tokens == n + 1  # <|return|> stopped it, as end-of-sequence


# --------------------------------------------------------------------------- the real pipeline


@pytest.mark.ray
def test_served_gpt_oss_store_answers_as_the_reference_parse(ray_cluster, gpt_oss_store):
    """A real deployment of the tiny gpt-oss store: the chat answer, streamed and not, equals
    the in-process engine's greedy tokens for the harmony-rendered prompt, split by the
    reference parser (a random model's output mostly does not follow the format; whatever it
    writes must come back split as the reference says)."""
    from engine.experts.runtime import load_from_store
    from engine.generate import Request
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine
    from services.app import deploy
    from services.config import DeployConfig
    from services.http.server import HttpSettings

    max_tokens = 40
    with load_from_store(gpt_oss_store, dense="bf16") as sm:
        tok = sm.tokenizer
        T = HarmonyTokens.from_tokenizer(tok)
        prompt = sm.tokenizer.apply_chat_template(MESSAGES)
        engine = Engine.for_requests(sm.model, sm.tokenizer, len(prompt) + max_tokens)
        raw = engine.generate([Request(prompt, SamplingConfig(max_tokens=max_tokens,
                                                              stop_token_ids=tuple(T.stop_ids)))])[0]
        want = split_reference(sm.tokenizer, T, raw.output_ids)
    app = deploy(DeployConfig(store=gpt_oss_store, namespace="moestream-harmony-test", loaders=1,
                              kv_budget="4MiB", prefetch_depth=0, dense_format="bf16",
                              request_timeout_s=120))
    try:
        host, port = app.start_http(HttpSettings(host="127.0.0.1", port=0,
                                                 namespace="moestream-harmony-test", model_name=MODEL))
        c = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=120)
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=0)
        msg = r.choices[0].message
        assert (msg.content, msg.model_extra["reasoning_content"]) == (want.content, want.reasoning)
        assert r.usage.completion_tokens == len(raw.output_ids)
        # this checkpoint (seed 15) writes 3 tokens outside the format, then <|call|>: the
        # engine must stop there although only the harmony format (not the tokenizer's
        # end-of-sequence ids, see test_router_knows_gpt_oss_writes_harmony) makes it a stop
        assert raw.output_ids[-1] == T.call and len(raw.output_ids) < max_tokens
        assert r.choices[0].finish_reason == "stop"
        content = reasoning = ""
        for ch in c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens,
                                            temperature=0, stream=True):
            if ch.choices:
                content += ch.choices[0].delta.content or ""
                reasoning += (ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        assert (content, reasoning) == (want.content, want.reasoning)
        assert want.content == tok.decode(raw.output_ids[:-1]) != ""  # not lost
    finally:
        app.shutdown()
