"""StepFrame (decode -> router: every request's output of one engine step in one frame) and
protocol.steps, which cuts a step into frames the codec's decoder accepts."""

from __future__ import annotations

import msgpack
import pytest

from protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    GenerateResult,
    ProtocolError,
    StepFrame,
    TokenChunk,
    Usage,
    decode,
    encode,
)
from protocol.messages import MAX_STEP_MESSAGES
from protocol.steps import message_cost, step_frames

USAGE = Usage(prompt_tokens=3, completion_tokens=1, prefill_tokens_per_s=1.0,
              decode_tokens_per_s=1.0)


def step_header(messages, seq=0) -> bytes:
    body = {"protocol_version": PROTOCOL_VERSION, "type": "step_frame", "seq": seq,
            "messages": messages}
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": "step_frame", "body": body,
                          "buffers": []}, use_bin_type=True)


def chunk_body(rid="r", **kw):
    return {"protocol_version": PROTOCOL_VERSION, "type": "token_chunk", "request_id": rid,
            "token_ids": [1], "text": "", **kw}


def invalid(frame_bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as ei:
        decode([frame_bytes], expect=StepFrame)
    assert ei.value.code is ErrorCode.INVALID_REQUEST, ei.value
    return ei.value


def test_round_trip_keeps_each_request_s_messages_in_order():
    msgs = [TokenChunk(request_id=f"r{i % 5}", token_ids=[i], text="") for i in range(40)]
    msgs.append(GenerateResult(request_id="r1", text="", token_ids=[1], finish_reason="length",
                               usage=USAGE))
    (frame,) = step_frames(msgs, 7)
    out, _ = decode(encode(frame), expect=StepFrame)
    assert out.seq == 7 and out.messages == msgs


@pytest.mark.parametrize("bad, loc", [
    (chunk_body(token_ids=[-1]), "messages[0].token_chunk.token_ids[0]"),
    (chunk_body(rid="no spaces"), "messages[0].token_chunk.request_id"),
    (chunk_body(protocol_version=2), "messages[0].token_chunk.protocol_version"),
    (chunk_body(extra=1), "messages[0].token_chunk.extra"),
    ({**chunk_body(), "type": "expert_fetch"}, "messages[0]"),  # not a stream message
    ({**chunk_body(), "type": "nope"}, "messages[0]"),
    ({"protocol_version": PROTOCOL_VERSION, "type": "error_reply", "code": "busy",
      "message": "m", "retryable": True}, "messages"),  # no request_id: cannot be routed
])
def test_hostile_messages_inside_a_frame_are_typed_errors_naming_the_field(bad, loc):
    err = invalid(step_header([chunk_body("ok"), bad][1:]))
    assert any(l.startswith(loc) for l, _ in err.field_errors), err.field_errors


def test_frame_level_bounds():
    invalid(step_header([], seq=-1))
    invalid(step_header([chunk_body(f"r{i}") for i in range(MAX_STEP_MESSAGES + 1)]))
    with pytest.raises(ProtocolError) as ei:  # a step frame where a request is expected
        decode(encode(StepFrame(seq=0, messages=[])), expect=TokenChunk)
    assert ei.value.code is ErrorCode.PROTOCOL


def heavy_chunk(i: int) -> TokenChunk:
    """A speculative step's chunk with 20 top logprobs per token: ~170 containers."""
    n = 8
    return TokenChunk(request_id=f"r{i}", token_ids=list(range(n)), text="",
                      logprobs=[-0.5] * n,
                      top_logprobs=[[{"token_id": k, "logprob": -1.0} for k in range(20)]] * n)


def test_a_big_step_is_cut_into_frames_the_decoder_accepts():
    msgs = [heavy_chunk(i) for i in range(300)]
    with pytest.raises(ProtocolError, match="arrays and maps"):  # one frame would be refused
        decode(encode(StepFrame(seq=0, messages=msgs)))
    frames = list(step_frames(msgs, 5))
    assert len(frames) > 1 and [f.seq for f in frames] == list(range(5, 5 + len(frames)))
    got = []
    for f in frames:
        out, _ = decode(encode(f), expect=StepFrame)
        got += out.messages
    assert got == msgs


def test_long_results_ending_together_get_frames_of_their_own():
    long = [GenerateResult(request_id=f"r{i}", text="", token_ids=[2**31 - 1] * 400_000,
                           finish_reason="length", usage=USAGE) for i in range(3)]
    frames = list(step_frames(long, 0))
    assert [len(f.messages) for f in frames] == [1, 1, 1]
    for f in frames:
        assert decode(encode(f))[0] == f


def test_small_steps_are_one_frame_and_nothing_is_one_empty_frame():
    msgs = [TokenChunk(request_id=f"r{i}", token_ids=[i], text="") for i in range(MAX_STEP_MESSAGES)]
    assert len(list(step_frames(msgs, 0))) == 1
    assert len(list(step_frames(msgs + msgs[:1], 0))) == 2  # the message count bound
    assert list(step_frames([], 4)) == [StepFrame(seq=4, messages=[])]


def test_cost_grows_with_what_a_message_carries():
    small = message_cost(TokenChunk(request_id="r", token_ids=[1], text=""))
    big = message_cost(heavy_chunk(0))
    err = message_cost(ErrorReply(request_id="r", code=ErrorCode.INTERNAL, message="x" * 4000,
                                  retryable=False))
    assert all(b > s for b, s in zip(big, small)) and err[2] > 4 * 4000


def test_ended_requests_ride_on_the_last_frame_after_their_messages():
    msgs = [heavy_chunk(i) for i in range(300)]
    frames = list(step_frames(msgs, 0, ended=["r1", "r2"]))
    assert [f.ended for f in frames] == [[]] * (len(frames) - 1) + [["r1", "r2"]]
    many = [f"r{i}" for i in range(2500)]
    frames = list(step_frames([], 9, ended=many))
    assert [f.seq for f in frames] == [9, 10, 11]
    assert [i for f in frames for i in f.ended] == many
    for f in frames:
        assert decode(encode(f), expect=StepFrame)[0] == f
    body = StepFrame(seq=0, messages=[]).model_dump(mode="json")
    with pytest.raises(ProtocolError) as ei:
        decode([msgpack.packb({"v": PROTOCOL_VERSION, "type": "step_frame", "buffers": [],
                               "body": {**body, "ended": ["bad id"]}})])
    assert ei.value.code is ErrorCode.INVALID_REQUEST and ei.value.field_errors[0][0] == "ended[0]"
