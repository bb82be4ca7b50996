"""The router's text stage gives the client exactly what the in-process engine gives: the same
text, the same tokens, the same finish, with stop strings and stop tokens, however the engine's
tokens are chunked. (The decode actor's engine runs without a tokenizer.)"""

from __future__ import annotations

import random

import pytest

from engine.experts.runtime import load_from_store
from engine.generate import Request
from engine.layers.sampler import SamplingConfig
from engine.runner import Engine
from services.text_stage import TextStage
from tests.services.conftest import DENSE


@pytest.fixture(scope="module")
def sm(store_path):
    with load_from_store(store_path, dense=DENSE) as s:
        yield s


def _engine_result(sm, prompt, sampling):
    engine = Engine.for_requests(sm.model, sm.tokenizer, len(prompt) + sampling.max_tokens)
    return engine.generate([Request(prompt, sampling)])[0]


def _via_stage(sm, prompt, sampling, chunking: random.Random):
    """The served path: the engine without stop strings, its tokens chunked as steps would
    stream them, text made by the stage, the request cut where the stage says."""
    raw = _engine_result(sm, prompt, SamplingConfig(max_tokens=sampling.max_tokens)).output_ids
    eos = set(sm.tokenizer.eos_token_ids) | set(sm.model.config.eos_token_ids)
    stage = TextStage(sm.tokenizer, prompt, sampling.stop, set(sampling.stop_token_ids) | eos)
    ids, text, i = [], "", 0
    while i < len(raw) and not stage.stopped:
        n = chunking.randint(1, 4)
        k, piece = stage.feed(raw[i:i + n])
        ids += raw[i:i + k]
        text += piece
        i += n
    text += stage.finish()
    return ids, text, stage


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_stage_equals_the_engine_with_stop_strings_and_tokens(sm, seed):
    rng = random.Random(seed)
    tok = sm.tokenizer
    prompt = tok.encode("the capital of france is")
    free = _engine_result(sm, prompt, SamplingConfig(max_tokens=24))
    assert len(free.text) > 6
    # a stop string from the middle of the free text, a stop token from its tokens, or none
    a = rng.randrange(1, len(free.text) - 3)
    stops = [free.text[a:a + rng.randint(1, 3)]]
    cases = [SamplingConfig(max_tokens=24, stop=tuple(stops)),
             SamplingConfig(max_tokens=24, stop_token_ids=(free.output_ids[rng.randrange(2, 10)],)),
             SamplingConfig(max_tokens=24)]
    for sampling in cases:
        want = _engine_result(sm, prompt, sampling)
        ids, text, stage = _via_stage(sm, prompt, sampling, rng)
        assert (ids, text) == (want.output_ids, want.text), sampling
        # the stop string occurs in the free text, so it (not EOS or length) ends case 0
        assert stage.by_string == (sampling is cases[0])
    assert stops[0] not in _engine_result(sm, prompt, cases[0]).text


def test_stage_without_tokenizer_counts_tokens_only():
    stage = TextStage(None, [1, 2], (), stop_ids={9})
    assert stage.feed([4, 5]) == (2, "")
    assert stage.feed([6, 9, 7]) == (2, "")  # the stop token is the last the client gets
    assert stage.stopped and not stage.by_string and stage.tokens == 4
    assert stage.feed([8]) == (0, "")
