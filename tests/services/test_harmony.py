"""gpt-oss's harmony format: the chat template renders harmony turns through our Tokenizer, and the
streaming channel parser (engine.harmony) and the router's text stage split an output into
reasoning (analysis) and answer exactly as the whole-output reference parse does, however the
tokens are chunked and wherever the stream stops; control tokens are never text, nothing is lost
when the output does not follow the format, stop strings and stop tokens end it."""

from __future__ import annotations

import itertools
import random

import pytest

from engine.harmony import (
    MAX_HEADER_TOKENS,
    HarmonyStreamParser,
    HarmonyTokens,
    harmony_tokens_for,
    parse_header,
    parse_reference,
    split_reference,
)
from engine.tokenizer import Tokenizer
from services.text_stage import HarmonyTextStage, TextStage
from tests.services.harmony_tiny import make_harmony_tokenizer

ANALYSIS = "Let me think: Café 日本 🙂 is the capital?"
FINAL = "Paris, naïve résumé."
SCRIPT = (f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>"
          f"<|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("harmony_tok")
    make_harmony_tokenizer(d)
    return Tokenizer.from_hf_dir(d)


@pytest.fixture(scope="module")
def T(tok):
    t = HarmonyTokens.from_tokenizer(tok)
    assert t is not None
    return t


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def run_stage(tok, T, ids, cuts=(), stop=(), stop_ids=None):
    """Feed ``ids`` to a HarmonyTextStage in chunks cut at ``cuts``; (tokens, content, reasoning)."""
    stage = HarmonyTextStage(tok, T, stop, T.stop_ids if stop_ids is None else stop_ids)
    bounds = [0, *sorted(cuts), len(ids)]
    n, content, reasoning = 0, "", ""
    for a, b in zip(bounds, bounds[1:]):
        k, c, r = stage.feed_parts(ids[a:b])
        n, content, reasoning = n + k, content + c, reasoning + r
        if stage.stopped:
            break
    c, r = stage.finish_parts()
    return n, content + c, reasoning + r, stage


# --------------------------------------------------------------------------- the template


def test_harmony_template_renders_through_our_tokenizer(tok, T):
    msgs = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Japan?"}]
    text = tok.render_chat_template(msgs)
    assert text == (
        "<|start|>system<|message|>You are a tiny test model.\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every "
        "message.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer briefly.<|end|>"
        "<|start|>user<|message|>What is the capital of France?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Paris.<|end|>"
        "<|start|>user<|message|>And of Japan?<|end|>"
        "<|start|>assistant")
    ids = tok.apply_chat_template(msgs)
    # every control token is one id, and the ids decode back to the rendered text
    assert ids.count(T.start) == 6 and ids.count(T.end) == 5 and ids.count(T.message) == 5
    tail = [T.start] + ids_of(tok, "assistant")  # the generation prompt
    assert ids.count(T.channel) == 1 and ids[-len(tail):] == tail
    assert tok.decode(ids, skip_special_tokens=False) == text
    # the reasoning effort is a template variable (the API's reasoning_effort)
    assert "\nReasoning: low\n" in tok.render_chat_template(msgs, reasoning_effort="low")
    # without a system turn there is no developer message
    assert "developer" not in tok.render_chat_template([{"role": "user", "content": "Hi"}])


def test_harmony_tokens_only_for_gpt_oss_with_the_control_tokens(tok, T, tmp_path):
    from tests.services.conftest import _add_tokenizer

    assert harmony_tokens_for("gpt_oss", tok) == T
    assert T.stop_ids == {T.ret, T.call}
    assert harmony_tokens_for("qwen3_moe", tok) is None  # other models: plain text
    _add_tokenizer(tmp_path, 96)  # the services' word-level tokenizer: no control tokens
    assert harmony_tokens_for("gpt_oss", Tokenizer.from_hf_dir(tmp_path)) is None


# --------------------------------------------------------------------------- the parser


def test_well_formed_output_splits_at_every_chunk_boundary(tok, T):
    ids = ids_of(tok, SCRIPT)
    assert ids[-1] == T.ret and len(ids) > 30
    # multi-byte characters span several byte-level tokens: a boundary can fall inside one
    assert len(ids_of(tok, "日本🙂")) > 3
    for cuts in itertools.chain([()], ((k,) for k in range(1, len(ids))),
                                itertools.combinations(range(1, len(ids), 3), 2)):
        n, content, reasoning, stage = run_stage(tok, T, ids, cuts)
        assert (n, content, reasoning) == (len(ids), FINAL, ANALYSIS), cuts
        assert stage.stopped and not stage.by_string
    msgs = stage.parser.messages
    assert [(m.channel, m.complete) for m in msgs] == [("analysis", True), ("final", True)]


def test_a_stream_cut_anywhere_keeps_what_was_written(tok, T):
    ids = ids_of(tok, SCRIPT)
    a_open = ids.index(T.message)
    a_close = ids.index(T.end)
    f_open = len(ids) - 1 - ids[::-1].index(T.message)
    for k in range(len(ids) + 1):
        prefix = ids[:k]
        _, content, reasoning, _ = run_stage(tok, T, prefix)
        want = split_reference(tok, T, prefix)
        assert (content, reasoning) == (want.content, want.reasoning), k
        # and what that means: reasoning so far, then the answer so far; headers never text
        if k <= a_open:
            assert (content, reasoning) == ("", "")
        elif k <= a_close:
            assert content == "" and reasoning == tok.decode(ids[a_open + 1:k])
        else:
            assert reasoning == ANALYSIS
            assert content == (tok.decode(ids[f_open + 1:min(k, len(ids) - 1)]) if k > f_open else "")


def _random_stream(rng: random.Random, T: HarmonyTokens, vocab: int) -> list[int]:
    control = [T.start, T.end, T.message, T.channel, T.constrain, T.ret, T.call]
    out = []
    for _ in range(rng.randint(0, 120)):
        r = rng.random()
        if r < 0.12:
            out.append(rng.choice(control[:5]))
        elif r < 0.14:
            out.append(rng.choice(control[5:]))
        else:
            out.append(rng.randrange(8, vocab))
    return out


def _well_formed(rng: random.Random, tok, T) -> list[int]:
    words = ["think", " about", " Paris", " é", "日本", "🙂", " yes", " no", " json", "{\"a\": 1}"]
    out: list[int] = []
    for m in range(rng.randint(1, 4)):
        if m:
            out += [T.start] + ids_of(tok, "assistant")
        head = f"<|channel|>{rng.choice(['analysis', 'final', 'commentary'])}"
        if rng.random() < 0.3:
            head += " to=functions.get_weather <|constrain|>json"
        out += ids_of(tok, head) + [T.message]
        out += ids_of(tok, "".join(rng.choice(words) for _ in range(rng.randint(0, 6))))
        out.append(T.end if m < 3 and rng.random() < 0.8 else rng.choice([T.ret, T.call]))
    if rng.random() < 0.5:
        out = out[:rng.randint(0, len(out))]  # max_tokens, or an abort
    if rng.random() < 0.2:  # a header longer than any real one: the format was left
        out = out[:2] + ids_of(tok, " word" * (MAX_HEADER_TOKENS + 5)) + out[2:]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_streaming_parser_equals_the_reference_on_random_streams(tok, T, seed):
    rng = random.Random(seed)
    for case in range(60):
        ids = _random_stream(rng, T, tok.vocab_size) if case % 2 else _well_formed(rng, tok, T)
        want = parse_reference(tok, T, ids)
        p = HarmonyStreamParser(tok, T)
        texts: dict[int, str] = {}
        for d in p.push_many(ids) + p.finish():
            assert d.text and d.channel == p.messages[d.index].channel
            texts[d.index] = texts.get(d.index, "") + d.text
        got = [(m.channel, m.role, m.recipient, m.content_type, m.text, m.complete) for m in p.messages]
        assert got == [(m.channel, m.role, m.recipient, m.content_type, m.text, m.complete)
                       for m in want], (seed, case, ids)
        assert [texts.get(i, "") for i in range(len(p.messages))] == [m.text for m in want]
        # the stage, chunked at random, gives the reference's split
        cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randint(0, 6)))) if ids else []
        _, content, reasoning, _ = run_stage(tok, T, ids, cuts)
        ref = split_reference(tok, T, ids)
        assert (content, reasoning) == (ref.content, ref.reasoning), (seed, case, ids, cuts)


def test_control_tokens_are_never_text(tok, T):
    rng = random.Random(7)
    names = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
             "<|call|>"]
    for _ in range(200):
        ids = _random_stream(rng, T, tok.vocab_size)
        _, content, reasoning, _ = run_stage(tok, T, ids)
        assert not any(n in content or n in reasoning for n in names)
        assert "channel" not in content + reasoning or "channel" in tok.decode(ids)


def test_header_fields(tok, T):
    assert parse_header("<|channel|>commentary to=functions.get_weather <|constrain|>json") == {
        "role": "assistant", "channel": "commentary", "recipient": "functions.get_weather",
        "content_type": "json"}
    assert parse_header("assistant to=functions.f<|channel|>commentary json") == {
        "role": "assistant", "channel": "commentary", "recipient": "functions.f", "content_type": "json"}
    assert parse_header("assistant") == {"role": "assistant", "channel": None, "recipient": None,
                                         "content_type": None}
    ids = ids_of(tok, "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                      "{\"location\": \"Tokyo\"}<|call|>")
    p = HarmonyStreamParser(tok, T)
    p.push_many(ids)
    p.finish()
    [m] = p.messages
    assert (m.channel, m.recipient, m.content_type, m.text, m.complete, p.stop_token) == (
        "commentary", "functions.get_weather", "json", "{\"location\": \"Tokyo\"}", True, T.call)
    # a tool call is not reasoning: it is returned as answer text (tools are not served)
    _, content, reasoning, stage = run_stage(tok, T, ids)
    assert (content, reasoning) == ("{\"location\": \"Tokyo\"}", "")


def test_messages_of_one_part_are_joined_by_a_newline(tok, T):
    ids = ids_of(tok, "<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>"
                      "commentary<|message|>I will look.<|end|><|start|>assistant<|channel|>analysis"
                      "<|message|>two<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>")
    for cut in range(len(ids)):
        _, content, reasoning, _ = run_stage(tok, T, ids, (cut,) if cut else ())
        assert (content, reasoning) == ("I will look.\nParis.", "one\ntwo")


def test_output_outside_the_format_is_not_lost(tok, T):
    text = "The capital of France is Paris. Café 日本"
    ids = ids_of(tok, text)
    assert len(ids) < MAX_HEADER_TOKENS
    _, content, reasoning, _ = run_stage(tok, T, ids)
    assert (content, reasoning) == (text, "")
    _, content, _, _ = run_stage(tok, T, ids + [T.ret])
    assert content == text
    # longer than any header: streamed as text from there on, before the stream ends
    long_ids = ids_of(tok, " hello world" * 40)
    stage = HarmonyTextStage(tok, T, (), T.stop_ids)
    streamed = "".join(stage.feed_parts(long_ids[:MAX_HEADER_TOKENS + 1])[1:])
    assert streamed and tok.decode(long_ids).startswith(streamed)
    rest = stage.feed_parts(long_ids[MAX_HEADER_TOKENS + 1:])[1] + stage.finish_parts()[0]
    assert streamed + rest == tok.decode(long_ids)
    # a header cut off after a message is a header, not text
    ids = ids_of(tok, "<|channel|>final<|message|>Paris.<|end|><|start|>assistant<|channel|>fin")
    assert run_stage(tok, T, ids)[1:3] == ("Paris.", "")


def test_stop_strings_and_stop_tokens(tok, T):
    ids = ids_of(tok, SCRIPT)
    # a stop string in the answer cuts the answer; the reasoning is whole
    n, content, reasoning, stage = run_stage(tok, T, ids, stop=("naïve",))
    assert (content, reasoning) == ("Paris, ", ANALYSIS) and stage.by_string and n < len(ids)
    # one in the reasoning ends the request there: no answer
    n, content, reasoning, stage = run_stage(tok, T, ids, stop=("日本",))
    assert (content, reasoning) == ("", "Let me think: Café ") and stage.by_string
    assert n <= ids.index(T.end)
    # withheld text of the other part is released when a stop string hits: "is" could start
    # "is the end" in the reasoning; the answer's stop string ends the request after it
    n, content, reasoning, _ = run_stage(tok, T, ids, stop=("capital?!", "résumé"))
    assert (content, reasoning) == ("Paris, naïve ", ANALYSIS)
    # <|call|> and <|return|> stop like end-of-sequence tokens: later ids are not the client's
    ids2 = ids_of(tok, "<|channel|>final<|message|>Paris.<|call|> more text<|end|>")
    n, content, reasoning, stage = run_stage(tok, T, ids2)
    assert (n, content) == (ids2.index(T.call) + 1, "Paris.") and stage.stopped


def test_plain_stage_parts_are_unchanged():
    """Other models: the text stage's parts are its text and no reasoning."""
    stage = TextStage(None, [1, 2], (), stop_ids={9})
    assert stage.feed_parts([4, 9, 5]) == (2, "", "")
    assert stage.finish_parts() == ("", "")


# --------------------------------------------------------------------------- the OpenAI shapes


def test_openai_shapes_with_and_without_reasoning():
    import json

    from protocol import GenerateResult, Usage
    from services.http.openai_format import Formatter

    def body(b: bytes) -> dict:
        assert b.startswith(b"data: ")
        return json.loads(b[6:])

    fmt = Formatter("chat", "chatcmpl-1", "m")
    assert body(fmt.chunk(reasoning="hmm"))["choices"][0]["delta"] == {"reasoning_content": "hmm"}
    assert body(fmt.chunk("Paris", reasoning="so"))["choices"][0]["delta"] == {
        "content": "Paris", "reasoning_content": "so"}
    assert body(fmt.chunk("Paris"))["choices"][0]["delta"] == {"content": "Paris"}
    usage = Usage(prompt_tokens=3, completion_tokens=4, prefill_tokens_per_s=1.0, decode_tokens_per_s=1.0)
    r = GenerateResult(request_id="r", text="Paris", token_ids=[1, 2, 3, 4], finish_reason="stop",
                       usage=usage, reasoning="think")
    msg = fmt.final(r, None)["choices"][0]["message"]
    assert (msg["content"], msg["reasoning_content"]) == ("Paris", "think")
    plain = fmt.final(r.model_copy(update={"reasoning": None}), None)["choices"][0]["message"]
    assert "reasoning_content" not in plain and plain["content"] == "Paris"
    assert fmt.final(r, None)["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
