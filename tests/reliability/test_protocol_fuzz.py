"""Property-based fuzzing of the wire protocol (msgpack codec + pydantic messages): whatever
arrives, decoding either returns a valid message or raises ProtocolError with a wire code and a
bounded message; building a model from arbitrary data raises only pydantic's ValidationError.
Derandomized and bounded, so a failure reproduces and CI time is fixed."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    ExpertFetch,
    ExpertReady,
    GenerateRequest,
    HealthReply,
    ProtocolError,
    SamplingParams,
    TokenChunk,
    decode,
    decode_frames,
    encode,
)
from protocol.messages import MAX_ERROR_MESSAGE_CHARS

FUZZ = settings(derandomize=True, max_examples=80, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

SHA = "ab" * 32
SEEDS = [  # one valid message of each kind, the starting points of the mutations
    encode(GenerateRequest(request_id="r-1", prompt="hello", sampling=SamplingParams(
        temperature=0.5, top_k=4, stop=["\n"], stop_token_ids=[2], seed=7, max_tokens=9))),
    encode(GenerateRequest(request_id="r-2", prompt_token_ids=[1, 2, 3], stream=True)),
    encode(GenerateRequest(request_id="r-3", messages=[{"role": "user", "content": "hi"}])),
    encode(TokenChunk(request_id="r", token_ids=[4, 5], text="ab", logprobs=[-0.1, -2.0])),
    encode(ExpertFetch(layer=3, expert=7, seq=11)),
    encode(ExpertReady(layer=3, expert=7, seq=11, nbytes=64, sha256=SHA,
                       shm_name="moestream.u0.ab.loader-0.1.ff", shm_offset=4096, tier="ram")),
    encode(ErrorReply.for_code(ErrorCode.BUSY, "queue full", "r")),
    encode(HealthReply(service="decode", ok=True, detail={"queue": 3, "rate": 0.5, "x": "y"})),
    encode(GenerateRequest(request_id="b", prompt="x"), [np.arange(6, dtype="<f4").reshape(2, 3)]),
]


def check_outcome(frames) -> None:
    """decode either gives a registered message that re-encodes to an equal one, or raises a
    ProtocolError with a known code and a bounded message. Anything else fails the test."""
    try:
        msg, views, descs = decode_frames(frames)
    except ProtocolError as e:
        assert e.code in (ErrorCode.PROTOCOL, ErrorCode.INVALID_REQUEST), e
        assert 0 < len(e.message) <= 2 * MAX_ERROR_MESSAGE_CHARS, len(e.message)
        assert ErrorReply.for_code(e.code, e.message).code is e.code  # it travels as a reply
        return
    assert MESSAGE_TYPES[msg.type] is type(msg)
    again, _ = decode(encode(msg, [bytes(v) for v in views]))
    assert again == msg and len(views) == len(descs)


# --------------------------------------------------------------------------- raw bytes


@FUZZ
@given(st.binary(max_size=512))
def test_random_header_bytes(data):
    check_outcome([data])


@FUZZ
@given(st.lists(st.one_of(st.binary(max_size=64), st.integers(), st.none(), st.text(max_size=8)),
                min_size=0, max_size=4))
def test_random_frame_lists_of_any_type(frames):
    check_outcome(frames)


# --------------------------------------------------------------------------- mutated frames


@st.composite
def mutated(draw):
    frames = [bytes(f) for f in draw(st.sampled_from(SEEDS))]
    head = bytearray(frames[0])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        i = draw(st.integers(0, max(len(head) - 1, 0)))
        if op == "flip" and head:
            head[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and head:
            head[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del head[i:]
        elif op == "insert":
            head[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and head:
            del head[i:i + draw(st.integers(1, 8))]
    frames[0] = bytes(head)
    if len(frames) > 1 and draw(st.booleans()):  # a buffer frame of the wrong size
        frames[1] = frames[1][:draw(st.integers(0, len(frames[1])))]
    return frames


@FUZZ
@given(mutated())
def test_mutated_valid_frames(frames):
    check_outcome(frames)


# --------------------------------------------------------------------------- well-formed msgpack


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                    st.text(max_size=12), st.sampled_from(["r", "hi", "user", "ram", SHA]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=8), inner, max_size=6)),
    max_leaves=30)


def _pack(obj) -> bytes | None:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):  # ints beyond 64 bits cannot be packed
        return None


@FUZZ
@given(values)
def test_any_msgpack_value_as_a_header(obj):
    frame = _pack(obj)
    if frame is not None:
        check_outcome([frame])


@FUZZ
@given(st.sampled_from(sorted(MESSAGE_TYPES)), st.dictionaries(
    st.sampled_from(["request_id", "prompt", "prompt_token_ids", "messages", "sampling", "stream",
                     "layer", "expert", "seq", "nbytes", "sha256", "shm_name", "shm_offset",
                     "handle", "tier", "token_ids", "text", "logprobs", "code", "message",
                     "retryable", "service", "ok", "detail", "index", "usage", "finish_reason",
                     "protocol_version", "type", "unknown"]), values, max_size=8))
def test_known_type_with_arbitrary_body(type_name, body):
    frame = _pack({"v": PROTOCOL_VERSION, "type": type_name, "body": body, "buffers": []})
    if frame is not None:
        check_outcome([frame])


@FUZZ
@given(st.lists(st.one_of(st.integers(-2**40, 2**40), st.floats(), st.booleans(), st.none()),
                min_size=1, max_size=40))
def test_token_id_lists_of_any_content(ids):
    """Bad items of any kind and number: one summarised error, or pydantic's per-item ones
    naming each bad index; good lists decode to the same ids."""
    frame = _pack({"v": PROTOCOL_VERSION, "type": "generate_request",
                   "body": {"request_id": "r", "prompt_token_ids": ids}})
    bad = [i for i, t in enumerate(ids) if type(t) is not int or not 0 <= t < 2**31]
    if not bad:
        msg, _ = decode([frame])
        assert msg.prompt_token_ids == ids
        return
    with pytest.raises(ProtocolError) as ei:
        decode([frame])
    assert ei.value.code is ErrorCode.INVALID_REQUEST
    locs = [loc for loc, _ in ei.value.field_errors]
    if len(bad) > 4:
        assert locs == ["prompt_token_ids"]
        assert f"{len(bad)} of {len(ids)} token ids" in ei.value.message
    else:
        assert locs == [f"prompt_token_ids[{i}]" for i in bad]


# --------------------------------------------------------------------------- the models directly


@FUZZ
@given(st.sampled_from(sorted(MESSAGE_TYPES)), st.dictionaries(st.text(max_size=12), values,
                                                                 max_size=8))
def test_models_raise_only_validation_errors(type_name, data):
    try:
        MESSAGE_TYPES[type_name].model_validate(data)
    except ValidationError as e:
        assert e.error_count() >= 1
