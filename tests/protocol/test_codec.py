"""The msgpack codec: round trips, zero-copy buffers, and hostile frames (checklist 39)."""

from __future__ import annotations

import math
import random
import struct
import time

import msgpack
import numpy as np
import pytest

from protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ChatMessage,
    ErrorCode,
    ErrorReply,
    ExpertEvict,
    ExpertFetch,
    ExpertReady,
    GenerateRequest,
    GenerateResult,
    HealthReply,
    HealthRequest,
    ProtocolError,
    SamplingParams,
    StepFrame,
    TokenChunk,
    Usage,
    buffer_as_numpy,
    decode,
    decode_frames,
    encode,
)
from protocol import codec

SHA = "0f" * 32


def sample_messages():
    usage = Usage(prompt_tokens=5, completion_tokens=2, prefill_tokens_per_s=100.0,
                  decode_tokens_per_s=20.5, expert_hit_rate=1.0, expert_bytes_per_token=0.0)
    return [
        GenerateRequest(request_id="a", prompt="Hello ✓",
                        sampling=SamplingParams(temperature=0.0, stop=["\n"], seed=1, n=8)),
        GenerateRequest(request_id="b", messages=[ChatMessage(role="user", content="hi")],
                        stream=True),
        GenerateRequest(request_id="c", prompt_token_ids=[0, 1, 2**31 - 1]),
        TokenChunk(request_id="a", index=7, token_ids=[3], text="x", logprobs=[-0.25]),
        GenerateResult(request_id="a", text="x", token_ids=[3], finish_reason="length",
                       usage=usage),
        ErrorReply(request_id="a", code=ErrorCode.CAPACITY, message="too long", retryable=False),
        ErrorReply(code=ErrorCode.PROTOCOL, message="bad", retryable=False),
        ExpertFetch(layer=1, expert=2, slot=3, seq=4),
        ExpertReady(layer=1, expert=2, seq=4, nbytes=64, sha256=SHA, shm_name="psm_x",
                    shm_offset=0, tier="nvme"),
        ExpertReady(layer=1, expert=2, seq=5, nbytes=64, sha256=SHA, handle="h:1", tier="ram"),
        ExpertEvict(layer=1, expert=2),
        HealthRequest(),
        HealthReply(service="decode", ok=True, detail={"q": 0, "rate": 0.5, "note": "ok"}),
        StepFrame(seq=3, messages=[
            TokenChunk(request_id="a", token_ids=[3, 4], text="", logprobs=[-0.5, -1.0]),
            TokenChunk(request_id="b", token_ids=[9], text=""),
            GenerateResult(request_id="a", text="", token_ids=[3, 4], finish_reason="stop",
                           usage=usage),
            ErrorReply(request_id="c", code=ErrorCode.EXPERT_LOAD, message="x", retryable=True),
        ]),
    ]


def pack(header) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def header_for(msg, **override):
    h = {"v": PROTOCOL_VERSION, "type": msg.type, "body": msg.model_dump(mode="json"),
         "buffers": []}
    h.update(override)
    return h


def protocol_error(frames, code=ErrorCode.PROTOCOL, match=None, **limits) -> ProtocolError:
    with pytest.raises(ProtocolError, match=match) as ei:
        decode(frames, **limits)
    assert ei.value.code is code, ei.value
    return ei.value


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("msg", sample_messages(), ids=lambda m: m.type)
def test_round_trip_every_message(msg):
    frames = encode(msg)
    assert len(frames) == 1 and isinstance(frames[0], bytes)
    out, buffers = decode(frames)
    assert type(out) is type(msg) and out == msg and buffers == []
    # through a "socket": frames copied into fresh bytes objects
    out2, _ = decode([bytes(f) for f in frames])
    assert out2 == msg


def test_all_types_covered():
    assert {m.type for m in sample_messages()} == set(MESSAGE_TYPES)


def test_header_layout():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    frames = encode(ExpertEvict(layer=0, expert=1), buffers=[a])
    header = msgpack.unpackb(frames[0])
    assert header == {
        "v": PROTOCOL_VERSION, "type": "expert_evict",
        "body": {"protocol_version": 1, "type": "expert_evict", "layer": 0, "expert": 1},
        "buffers": [{"dtype": "<f4", "shape": [2, 3], "nbytes": 24}],
    }
    assert b"pickle" not in frames[0]


def test_numpy_buffer_round_trips_zero_copy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(5, dtype=np.int64)
    frames = encode(HealthRequest(), buffers=[a, b])
    assert len(frames) == 3 and all(isinstance(f, memoryview) for f in frames[1:])
    assert np.shares_memory(a, np.frombuffer(frames[1], dtype=np.uint8))  # encode did not copy
    msg, views, descs = decode_frames(frames)
    assert isinstance(msg, HealthRequest) and all(isinstance(v, memoryview) for v in views)
    out_a = buffer_as_numpy(views[0], descs[0])
    out_b = buffer_as_numpy(views[1], descs[1])
    assert np.shares_memory(a, out_a) and np.shares_memory(b, out_b)  # decode did not copy
    np.testing.assert_array_equal(out_a, a)
    np.testing.assert_array_equal(out_b, b)
    assert (out_a.dtype, out_a.shape) == (a.dtype, a.shape)
    a[0, 0] = 42.0  # proof it is the same memory, not just equal bytes
    assert out_a[0, 0] == 42.0


def test_buffers_after_a_copy_still_decode():
    a = (np.arange(8, dtype=np.float16) / 3).reshape(2, 2, 2)
    frames = [bytes(f) for f in encode(HealthRequest(), buffers=[a])]
    _, views, descs = decode_frames(frames)
    out = buffer_as_numpy(views[0], descs[0])
    np.testing.assert_array_equal(out, a)
    assert not np.shares_memory(out, a)


@pytest.mark.parametrize(
    "buf",
    [
        b"raw bytes",
        bytearray(b"\x00\x01"),
        np.zeros((0, 3), dtype=np.float64),
        np.array(3.5),
        np.array([True, False]),
        np.arange(4, dtype=">i4"),
        np.zeros(3, dtype=np.complex64),
        np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),
    ],
    ids=lambda b: type(b).__name__ + str(getattr(b, "dtype", "")),
)
def test_various_buffers_round_trip(buf):
    frames = encode(HealthRequest(), buffers=[buf])
    _, views, descs = decode_frames(frames)
    want = np.ascontiguousarray(buf).tobytes() if isinstance(buf, np.ndarray) else bytes(buf)
    assert bytes(views[0]) == want
    if isinstance(buf, np.ndarray):
        out = buffer_as_numpy(views[0], descs[0])
        assert out.shape == buf.shape
        if buf.dtype.names:  # structured dtypes travel as opaque void records of the same size
            assert out.dtype == np.dtype(f"V{buf.dtype.itemsize}")
        else:
            assert out.dtype == buf.dtype
            np.testing.assert_array_equal(out, buf)


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError, match="not C-contiguous"):
        encode(HealthRequest(), buffers=[np.zeros((4, 4))[:, ::2]])
    with pytest.raises(TypeError, match="buffer protocol"):
        encode(HealthRequest(), buffers=["a string"])
    with pytest.raises(TypeError, match="not a registered wire message"):
        encode(SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode({"type": "health_request"})  # type: ignore[arg-type]


def test_decode_accepts_zmq_frames():
    zmq = pytest.importorskip("zmq")
    a = np.arange(4, dtype=np.uint16)
    frames = [zmq.Frame(bytes(f)) for f in encode(ExpertFetch(layer=1, expert=1, seq=9), [a])]
    msg, views, descs = decode_frames(frames)
    assert msg == ExpertFetch(layer=1, expert=1, seq=9)
    np.testing.assert_array_equal(buffer_as_numpy(views[0], descs[0]), a)


def test_expect_restricts_message_types():
    frames = encode(HealthRequest())
    assert isinstance(decode(frames, expect=(HealthRequest, ExpertFetch))[0], HealthRequest)
    protocol_error(frames, match="unexpected message type", expect=GenerateRequest)


def test_largest_legal_request_is_fast():
    msg = GenerateRequest(request_id="big", prompt_token_ids=list(range(1_000_000)))
    t0 = time.perf_counter()
    out, _ = decode(encode(msg))
    assert out.prompt_token_ids == msg.prompt_token_ids
    assert time.perf_counter() - t0 < 5.0


# --------------------------------------------------------------------------- hostile frames

MALFORMED = {
    "reserved byte 0xc1": b"\xc1",
    "truncated map": b"\x84\xa1v\x01",
    "truncated str": b"\xa5ab",
    "array32 claims 2^32-1": b"\xdd\xff\xff\xff\xff",
    "map32 claims 2^32-1": b"\xdf\xff\xff\xff\xff",
    "str32 claims 2^32-1": b"\xdb\xff\xff\xff\xff",
    "bin32 claims 2^32-1": b"\xc6\xff\xff\xff\xff",
    "ext32 claims 2^32-1": b"\xc9\xff\xff\xff\xff\x05",
    "array16 of 65535 nils short": b"\xdc\xff\xff" + b"\xc0" * 10,
    "deep nesting 100k": b"\x91" * 100_000 + b"\x01",
    "deep nesting 2000 maps": b"\x81\xa1k" * 2000 + b"\x01",
    "fixext ext type 5": b"\xd4\x05\x00",
    "ext8 zero-length": b"\xc7\x00\x05",
    "timestamp ext -1": b"\xd6\xff\x00\x00\x00\x00",
    "invalid utf-8 string": b"\xa3\xff\xfe\xfd",
    "int map key": b"\x81\x01\x02",
    "trailing bytes": pack({"v": 1}) + b"\x00",
    "pickle payload": b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00\x8c\x01a\x94.",
    "json": b'{"v": 1, "type": "health_request"}',
    "empty": b"",
    "a list": pack([1, 2, 3]),
    "a string": pack("health_request"),
    "nil": b"\xc0",
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_header_frames_are_protocol_errors(raw):
    protocol_error([raw])
    protocol_error([raw, b"extra buffer"])


def test_deep_but_valid_msgpack_nesting_is_rejected():
    deep: object = 1
    for _ in range(100):
        deep = [deep]
    raw = pack(header_for(HealthRequest(), body={"type": "health_request", "x": deep}))
    protocol_error([raw], match="deeper than")


def test_allocation_bombs_stop_early():
    """A few MB of empty maps, or many big arrays, must not become GBs of Python objects."""
    empty_maps = b"\xdd" + (1_000_000).to_bytes(4, "big") + b"\x80" * 1_000_000
    protocol_error([empty_maps], match="more than 4096 arrays and maps")
    two_big = pack([[1000] * 600_000, [1000] * 600_000])
    protocol_error([two_big], match="array/map items")


def test_ext_inside_an_otherwise_valid_header():
    h = header_for(HealthRequest())
    h["body"]["when"] = msgpack.ExtType(5, b"x")
    protocol_error([pack(h)], match="ext")
    h["body"]["when"] = msgpack.Timestamp(0)
    protocol_error([pack(h)])


def test_bin_inside_header_is_rejected():
    h = header_for(GenerateRequest(request_id="r", prompt="p"))
    h["body"]["prompt"] = b"bytes not str"
    protocol_error([pack(h)], match="binary data is not allowed")


@pytest.mark.parametrize("frames", [[], (), None, "frame", b"frame"], ids=repr)
def test_frames_must_be_a_nonempty_list(frames):
    protocol_error(frames)


def test_non_bytes_frames():
    protocol_error([12345])
    protocol_error([encode(HealthRequest())[0], object()])


@pytest.mark.parametrize("v", [0, 2, 2**64 - 1, -1, "1", 1.0, True, None, [1]], ids=repr)
def test_wrong_version(v):
    err = protocol_error([pack(header_for(HealthRequest(), v=v))], match="protocol version")
    assert "this build speaks 1" in err.message


def test_missing_version():
    h = header_for(HealthRequest())
    del h["v"]
    protocol_error([pack(h)], match="no protocol version")


def test_body_version_or_type_disagreeing_with_header():
    h = header_for(HealthRequest())
    h["body"]["protocol_version"] = 2
    protocol_error([pack(h)], match="protocol_version")
    h = header_for(HealthRequest())
    h["body"]["type"] = "expert_evict"
    protocol_error([pack(h)], match="body type")


@pytest.mark.parametrize(
    "t", ["nope", "", "GenerateRequest", None, 3, ["health_request"]], ids=repr
)
def test_unknown_type(t):
    protocol_error([pack(header_for(HealthRequest(), type=t))], match="unknown message type")


def test_missing_type_and_body_and_extra_keys():
    h = header_for(HealthRequest())
    del h["type"]
    protocol_error([pack(h)], match="unknown message type")
    protocol_error([pack(header_for(HealthRequest(), body=[1]))], match="body must be a map")
    h = header_for(HealthRequest())
    del h["body"]
    protocol_error([pack(h)], match="body must be a map")
    protocol_error([pack(header_for(HealthRequest(), pickle=1))], match="unknown header keys")


def test_oversized_header_frame():
    frames = encode(GenerateRequest(request_id="r", prompt="x" * 1000))
    protocol_error(frames, match="header frame is .* bytes; the limit is 512", max_frame_bytes=512)
    huge = pack(header_for(HealthRequest(), body={"x": "y" * (17 * 1024 * 1024)}))
    protocol_error([huge], match="the limit is 16777216")


def test_oversized_list_inside_header():
    h = header_for(GenerateRequest(request_id="r", prompt_token_ids=[1]))
    h["body"]["prompt_token_ids"] = [1] * 1_000_001
    protocol_error([pack(h)], match="max_array_len")


def test_buffer_count_mismatch():
    a = np.zeros(4, dtype=np.uint8)
    frames = encode(HealthRequest(), buffers=[a])
    protocol_error(frames[:1], match="describes 1 buffers but 0")
    protocol_error([*frames, b"more"], match="describes 1 buffers but 2")
    protocol_error([encode(HealthRequest())[0], b"unannounced"], match="describes 0 buffers")


def test_buffer_size_mismatch():
    a = np.zeros(4, dtype=np.float32)
    header, view = encode(HealthRequest(), buffers=[a])
    protocol_error([header, bytes(view)[:-1]], match="15 bytes but its descriptor says 16")
    protocol_error([header, bytes(view) + b"\x00"], match="17 bytes")


@pytest.mark.parametrize(
    ("desc", "match"),
    [
        ({"dtype": "<f4", "shape": [5], "nbytes": 16}, "inconsistent"),
        ({"dtype": "<f4", "shape": [2**40, 2**40], "nbytes": 16}, "inconsistent"),
        ({"dtype": "<f4", "shape": [-4], "nbytes": 16}, "shape"),
        ({"dtype": "<f4", "shape": [1] * 33, "nbytes": 16}, "shape"),
        ({"dtype": "<f4", "shape": [4], "nbytes": -16}, "nbytes"),
        ({"dtype": "object", "shape": [4], "nbytes": 16}, "unknown dtype"),
        ({"dtype": "O", "shape": [4], "nbytes": 16}, "unknown dtype"),
        ({"dtype": "0s", "shape": [4], "nbytes": 16}, "unknown dtype"),
        ({"dtype": "<f4", "shape": [4]}, "nbytes"),
        ({"dtype": "<f4", "shape": [4], "nbytes": 16, "pickle": True}, "pickle"),
        ("not a map", "buffer descriptor 0"),
    ],
)
def test_bad_buffer_descriptors(desc, match):
    h = header_for(HealthRequest(), buffers=[desc])
    protocol_error([pack(h), bytes(16)], match=match)


def test_buffer_limits():
    a = np.zeros(1024, dtype=np.uint8)
    frames = encode(HealthRequest(), buffers=[a])
    protocol_error(frames, match="limit is 512", max_buffer_bytes=512)
    many = encode(HealthRequest(), buffers=[b"x"] * 65)
    protocol_error(many, match="65 buffer frames; the limit is 64")
    assert len(decode(many, max_buffers=65)[1]) == 65


# --------------------------------------------------------------------------- invalid bodies

INVALID_BODIES = [
    ("sampling.temperature", {"sampling": {"temperature": math.nan}}),
    ("sampling.temperature", {"sampling": {"temperature": math.inf}}),
    ("sampling.temperature", {"sampling": {"temperature": -1.0}}),
    ("sampling.top_p", {"sampling": {"top_p": 0.0}}),
    ("sampling.top_p", {"sampling": {"top_p": 1.5}}),
    ("sampling.max_tokens", {"sampling": {"max_tokens": 0}}),
    ("sampling.max_tokens", {"sampling": {"max_tokens": -1}}),
    ("sampling.max_tokens", {"sampling": {"max_tokens": 2**31}}),
    ("sampling.n", {"sampling": {"n": 10**6}}),
    ("sampling.stop", {"sampling": {"stop": ["x"] * 100_000}}),
    ("sampling.seed", {"sampling": {"seed": 2**64 - 1}}),
    ("prompt", {"prompt": ""}),
    ("prompt_token_ids[1]", {"prompt": None, "prompt_token_ids": [1, -5]}),
    ("request_id", {"request_id": "bad id!"}),
    ("stream", {"stream": 1}),
    ("unknown", {"unknown": 1}),
]


@pytest.mark.parametrize(("loc", "change"), INVALID_BODIES, ids=lambda v: str(v)[:30])
def test_invalid_bodies_are_invalid_request_naming_the_field(loc, change):
    h = header_for(GenerateRequest(request_id="r", prompt="p"))
    for key, value in change.items():
        if isinstance(value, dict):
            h["body"][key].update(value)
        else:
            h["body"][key] = value
    err = protocol_error([pack(h)], code=ErrorCode.INVALID_REQUEST)
    assert loc in [f_loc for f_loc, _ in err.field_errors], err.field_errors
    assert loc in err.message and err.message.startswith("invalid generate_request: ")
    assert len(err.message) < 2000
    reply = ErrorReply.from_exception(err, request_id="r")
    assert reply.code is ErrorCode.INVALID_REQUEST and not reply.retryable


def test_empty_prompt_via_no_prompt_at_all():
    h = header_for(GenerateRequest(request_id="r", prompt="p"))
    h["body"]["prompt"] = None
    err = protocol_error([pack(h)], code=ErrorCode.INVALID_REQUEST)
    assert "exactly one of" in err.message


def test_body_missing_optional_keys_uses_defaults():
    h = {"v": 1, "type": "generate_request", "body": {"request_id": "r", "prompt": "p"},
         "buffers": []}
    msg, _ = decode([pack(h)])
    assert msg == GenerateRequest(request_id="r", prompt="p")
    del h["buffers"]
    assert decode([pack(h)])[0] == msg


# --------------------------------------------------------------------------- fuzz


def test_random_mutations_never_escape_as_other_errors():
    """Flip, cut and splice bytes of real frames: every outcome is a message or a ProtocolError."""
    rng = random.Random(1234)
    seeds = [bytes(encode(m)[0]) for m in sample_messages()]
    outcomes = {"ok": 0, "protocol": 0}
    for _ in range(3000):
        raw = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            pos = rng.randrange(len(raw))
            if op < 0.5:
                raw[pos] = rng.randrange(256)
            elif op < 0.7:
                del raw[pos:]
            elif op < 0.85:
                raw[pos:pos] = struct.pack(">BI", rng.choice([0xDD, 0xDF, 0xDB, 0xC6, 0xC9]),
                                           rng.randrange(2**32))
            else:
                raw[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            if not raw:
                break
        try:
            decode([bytes(raw)])
            outcomes["ok"] += 1
        except ProtocolError as e:
            assert e.code in (ErrorCode.PROTOCOL, ErrorCode.INVALID_REQUEST)
            outcomes["protocol"] += 1
    assert outcomes["protocol"] > 2000


def test_module_does_not_use_pickle():
    import inspect

    src = inspect.getsource(codec)
    assert "import pickle" not in src and "cloudpickle" not in src
