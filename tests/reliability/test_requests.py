"""Bad requests at the API (issue 14, classes 2 and 3): a request carrying 10^6 invalid token
ids costs one short error, not 10^6 error objects (peak memory bounded), in the protocol models,
the codec and the engine alike; float token ids and bool counts are refused with a typed error."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import msgpack
import pytest
import torch
from pydantic import ValidationError

from engine.errors import RequestValidationError
from engine.generate import generate_ids, validate_prompt
from engine.kv.paged import PagedKVCache
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model, resident_experts
from engine.runner import Engine
from protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    ExpertFetch,
    GenerateRequest,
    GenerateResult,
    ProtocolError,
    SamplingParams,
    TokenChunk,
    decode,
)
from tests.engine.models.hf_tiny import make_checkpoint

PEAK_MIB = 64  # growth allowed over the baseline; pydantic's per-item errors took ~870 MiB


def _peak_growth(setup: str, action: str) -> dict:
    """Run ``action`` in a fresh interpreter after ``setup``; returns its message and how far
    the peak RSS rose above the peak before it (MiB)."""
    code = "\n".join(["import json, resource", setup, textwrap.dedent(f"""
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            {action}
            msg, kind = None, None
        except Exception as e:
            msg, kind = str(e), type(e).__name__
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print(json.dumps({{"message": msg, "kind": kind, "grown_mib": grown}}))
    """)])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_protocol_model_reports_a_million_bad_ids_in_one_bounded_error():
    r = _peak_growth("from protocol import GenerateRequest\nids = [-1] * 10**6",
                     "GenerateRequest(request_id='r', prompt_token_ids=ids)")
    assert r["kind"] == "ValidationError", r
    assert "1 validation error" in r["message"]
    assert "1000000 of 1000000 token ids are not integers in [0, 2147483647]" in r["message"]
    assert "first: [0]=-1, [1]=-1, [2]=-1, [3]=-1" in r["message"]
    assert r["grown_mib"] < PEAK_MIB, r


def test_codec_reports_a_million_bad_ids_in_one_bounded_error():
    setup = ("import msgpack\nfrom protocol import decode\n"
             "frame = msgpack.packb({'v': 1, 'type': 'generate_request', 'body': "
             "{'request_id': 'r', 'prompt_token_ids': [2**40] * 10**6}}, use_bin_type=True)")
    r = _peak_growth(setup, "decode([frame])")
    assert r["kind"] == "ProtocolError", r
    assert r["message"].startswith("invalid generate_request: prompt_token_ids: 1000000 of 1000000")
    assert "first: [0]=1099511627776" in r["message"] and len(r["message"]) < 400
    assert r["grown_mib"] < PEAK_MIB, r


def test_engine_reports_a_million_bad_ids_in_one_bounded_error():
    r = _peak_growth("from engine.generate import validate_prompt\nids = [1.5] * 10**6",
                     "validate_prompt(ids, 100, 1, 10**7)")
    assert r["kind"] == "RequestValidationError", r
    assert r["message"] == ("1000000 of 1000000 prompt token ids out of range or not integers "
                            "(first: [0]=1.5, [1]=1.5, [2]=1.5, [3]=1.5); allowed: integers "
                            "0 <= id < vocab size 100")
    assert r["grown_mib"] < PEAK_MIB, r


def test_a_few_bad_ids_keep_pydantics_per_item_errors_more_are_summarised():
    with pytest.raises(ValidationError) as ei:
        GenerateRequest(request_id="r", prompt_token_ids=[5, -1, 7, -2, -3, -4])
    assert [e["loc"] for e in ei.value.errors()] == [("prompt_token_ids", i) for i in (1, 3, 4, 5)]
    with pytest.raises(ValidationError) as ei:
        GenerateRequest(request_id="r", prompt_token_ids=[-1, 5, -2, 2.0, -3, True, 7])
    (err,) = ei.value.errors()
    assert err["loc"] == ("prompt_token_ids",) and err["type"] == "invalid_items"
    assert err["msg"] == ("5 of 7 token ids are not integers in [0, 2147483647]; "
                          "first: [0]=-1, [2]=-2, [3]=2.0, [4]=-3")
    huge = [2**4000] * 5  # an error never prints a 1200-digit number
    with pytest.raises(ValidationError, match=r"first: \[0\]=<4001-bit integer>"):
        GenerateRequest(request_id="r", prompt_token_ids=huge)


@pytest.mark.parametrize("make", [
    lambda ids: TokenChunk(request_id="r", token_ids=ids, text=""),
    lambda ids: GenerateResult(request_id="r", text="", token_ids=ids, finish_reason="stop",
                               usage={"prompt_tokens": 1, "completion_tokens": 1,
                                      "prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0}),
    lambda ids: SamplingParams(stop_token_ids=ids[:64]),
])
def test_every_token_id_list_is_bounded_the_same_way(make):
    with pytest.raises(ValidationError) as ei:
        make([-1] * 64)
    assert ei.value.error_count() == 1
    assert "64 of 64 token ids are not integers" in str(ei.value)


def test_logprobs_lists_are_bounded_too():
    with pytest.raises(ValidationError) as ei:
        TokenChunk(request_id="r", token_ids=[1] * 10, text="", logprobs=[float("nan")] * 10)
    assert ei.value.error_count() == 1 and "10 of 10 values are not finite numbers" in str(ei.value)


# --------------------------------------------------------------------------- class 3: types


@pytest.mark.parametrize("kwargs, loc", [
    ({"prompt_token_ids": [1.0, 2]}, ("prompt_token_ids", 0)),
    ({"prompt_token_ids": [True]}, ("prompt_token_ids", 0)),
    ({"prompt": "x", "sampling": {"max_tokens": True}}, ("sampling", "max_tokens")),
    ({"prompt": "x", "sampling": {"max_tokens": 4.0}}, ("sampling", "max_tokens")),
    ({"prompt": "x", "sampling": {"seed": 1.0}}, ("sampling", "seed")),
    ({"prompt": "x", "sampling": {"n": True}}, ("sampling", "n")),
])
def test_protocol_refuses_floats_and_bools_where_ints_belong(kwargs, loc):
    with pytest.raises(ValidationError) as ei:
        GenerateRequest(request_id="r", **kwargs)
    assert [e["loc"] for e in ei.value.errors()] == [loc]
    body = {"request_id": "r", **kwargs}  # the same over the wire: a typed ProtocolError
    frame = msgpack.packb({"v": PROTOCOL_VERSION, "type": "generate_request", "body": body})
    with pytest.raises(ProtocolError) as pe:
        decode([frame])
    assert pe.value.code is ErrorCode.INVALID_REQUEST
    want = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc))
    assert [f for f, _ in pe.value.field_errors] == [want]
    with pytest.raises(ValidationError):
        ExpertFetch(layer=True, expert=0, seq=0)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", True), ("max_tokens", 4.0), ("top_k", False), ("seed", 3.0), ("logprobs", True),
    ("temperature", True), ("top_p", False), ("ignore_eos", 1), ("stop_token_ids", (2.0,)),
    ("stop_token_ids", (True,)), ("stop", ("ok", 3)),
])
def test_sampling_config_refuses_floats_and_bools_where_ints_belong(field, value):
    with pytest.raises(RequestValidationError, match=rf"^{field}=\S+ is invalid; allowed: "):
        SamplingConfig(**{field: value})


def test_sampling_config_still_takes_numpy_integers():
    import numpy as np

    c = SamplingConfig(max_tokens=np.int64(3), top_k=np.int32(2), seed=np.uint64(7),
                       temperature=np.float32(0.5), stop_token_ids=(np.int64(2),))
    assert (c.max_tokens, c.top_k, c.seed) == (3, 2, 7)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moe")
    make_checkpoint("qwen3_moe", path, seed=1)
    files = open_model_files(path)
    return build_model(files.config, files.source,
                       provider=resident_experts(files.config, files.source, torch.float32))


@pytest.mark.parametrize("ids, first", [
    ([5, 6.0, 7], "[1]=6.0"), ([True, 5], "[0]=True"), ([5, "6"], "[1]='6'"),
    ([5, None], "[1]=NoneType"), ([5, 96], "[1]=96"), ([-1], "[0]=-1"),
])
def test_engine_refuses_float_bool_and_out_of_range_ids(tiny, ids, first):
    msg = rf"1 of {len(ids)} prompt token ids out of range or not integers \(first: {re.escape(first)}\)"
    with pytest.raises(RequestValidationError, match=msg):
        next(generate_ids(tiny, ids, SamplingConfig(max_tokens=2)))
    c = tiny.config
    engine = Engine(tiny, kv=PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 8, 4, torch.float32))
    with pytest.raises(RequestValidationError, match=msg):
        engine.add_request("bad", ids, SamplingConfig(max_tokens=2))
    assert not engine.has_unfinished() and engine.kv.pool.num_free == 8
    engine.add_request("ok", [5, 6], SamplingConfig(max_tokens=2, ignore_eos=True))  # unaffected
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [(o.request_id, o.finished) for o in outs] == [("ok", False), ("ok", True)]
    assert engine.kv.pool.num_free == 8


def test_engine_refuses_a_non_sequence_prompt():
    with pytest.raises(RequestValidationError, match="must be a sequence of token ids, got str"):
        validate_prompt("12", 100, 1, 100)
    with pytest.raises(RequestValidationError, match=r"max_tokens \(<20001-bit integer>\) exceeds"):
        validate_prompt([1], 100, 2**20000, 100)
