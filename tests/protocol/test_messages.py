"""Message models and error codes: bounds, strictness, descriptions, the engine-error map."""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

import engine.errors as engine_errors
from protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    BufferDescriptor,
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
    WireMessage,
    code_for_exception,
    code_for_exception_name,
)
from protocol.errors import EXCEPTION_CODES

REPO = Path(__file__).resolve().parents[2]
SHA = "ab" * 32


def sample_messages() -> list[WireMessage]:
    """One (or more) filled-in instance of every message type."""
    usage = Usage(
        prompt_tokens=7,
        completion_tokens=3,
        prefill_tokens_per_s=512.5,
        decode_tokens_per_s=33.0,
        expert_hit_rate=0.81,
        expert_bytes_per_token=1.24e9,
    )
    return [
        GenerateRequest(
            request_id="req-1:a.b_c",
            prompt="The capital of France is",
            sampling=SamplingParams(
                temperature=0.0, top_k=40, top_p=0.9, min_p=0.05, seed=2**63 - 1,
                max_tokens=16, stop=["\n\n", "END"], stop_token_ids=[2, 0],
                logprobs=5, n=2, presence_penalty=-2.0, frequency_penalty=2.0,
                repetition_penalty=1.1,
            ),
            stream=True,
        ),
        GenerateRequest(
            request_id="chat",
            messages=[
                ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", content="Héllo ✓"),
                ChatMessage(role="assistant", content=""),
            ],
        ),
        GenerateRequest(request_id="ids", prompt_token_ids=[1, 0, 2**31 - 1]),
        TokenChunk(request_id="r", index=1, token_ids=[5, 6], text="ab", logprobs=[-0.5, -1e-9]),
        TokenChunk(request_id="r", token_ids=[], text=""),
        GenerateResult(
            request_id="r", index=0, text="Paris.", token_ids=[9, 10], finish_reason="stop",
            usage=usage,
        ),
        GenerateResult(
            request_id="r", text="", token_ids=[], finish_reason="abort",
            usage=Usage(prompt_tokens=1, completion_tokens=0, prefill_tokens_per_s=0,
                        decode_tokens_per_s=0),
        ),
        ErrorReply(request_id="r", code=ErrorCode.BUSY, message="queue full (64)", retryable=True),
        ErrorReply(code=ErrorCode.PROTOCOL, message="bad frame", retryable=False),
        ExpertFetch(layer=3, expert=511, slot=17, seq=42),
        ExpertFetch(layer=0, expert=0, seq=0),
        ExpertReady(layer=3, expert=511, seq=42, nbytes=4096, sha256=SHA, shm_name="/psm_ring0",
                    shm_offset=8192, tier="ram"),
        ExpertReady(layer=1, expert=2, seq=1, nbytes=0, sha256=SHA, handle="ray-obj:abc",
                    tier="nvme"),
        ExpertEvict(layer=47, expert=3),
        HealthRequest(),
        HealthReply(service="expert_loader.3", ok=True,
                    detail={"queue": 3, "hit_rate": 0.5, "last_error": ""}),
        StepFrame(seq=0, messages=[
            TokenChunk(request_id="r", token_ids=[5], text=""),
            GenerateResult(request_id="q", text="", token_ids=[], finish_reason="abort",
                           usage=Usage(prompt_tokens=1, completion_tokens=0,
                                       prefill_tokens_per_s=0, decode_tokens_per_s=0)),
            ErrorReply(request_id="p", code=ErrorCode.BUSY, message="full", retryable=True),
        ]),
        StepFrame(seq=2**63 - 1, messages=[]),
    ]


# --------------------------------------------------------------------------- structure


def test_every_message_type_is_registered_and_sampled():
    assert set(MESSAGE_TYPES) == {m.type for m in sample_messages()}
    for name, cls in MESSAGE_TYPES.items():
        assert cls.model_fields["type"].default == name
        assert issubclass(cls, WireMessage)


@pytest.mark.parametrize("msg", sample_messages(), ids=lambda m: m.type)
def test_json_dump_round_trip(msg):
    body = msg.model_dump(mode="json")
    assert body["protocol_version"] == PROTOCOL_VERSION
    assert body["type"] == msg.type
    again = type(msg).model_validate(body)
    assert again == msg


def _all_models():
    import protocol.messages as m

    models = {
        obj
        for mod in (m, sys.modules["protocol.codec"])
        for obj in vars(mod).values()
        if inspect.isclass(obj) and issubclass(obj, BaseModel) and obj.__module__ == mod.__name__
    }
    assert {SamplingParams, ChatMessage, Usage, BufferDescriptor, *MESSAGE_TYPES.values()} <= models
    return sorted(models, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", _all_models(), ids=lambda c: c.__name__)
def test_every_field_has_a_description(cls):
    missing = [name for name, f in cls.model_fields.items() if not (f.description or "").strip()]
    assert not missing, f"{cls.__name__} fields without description: {missing}"


@pytest.mark.parametrize("cls", _all_models(), ids=lambda c: c.__name__)
def test_models_are_strict_closed_and_frozen(cls):
    cfg = cls.model_config
    assert cfg.get("strict") is True and cfg.get("extra") == "forbid" and cfg.get("frozen")


def test_messages_are_frozen():
    msg = sample_messages()[0]
    with pytest.raises(ValidationError):
        msg.request_id = "other"  # type: ignore[misc]


def test_protocol_imports_neither_torch_ray_nor_engine():
    code = (
        "import sys, protocol, protocol.codec, protocol.messages, protocol.errors\n"
        "bad = [m for m in ('torch', 'ray', 'engine', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env)


# --------------------------------------------------------------------------- versions / types


@pytest.mark.parametrize("version", [0, 2, 99, -1])
def test_unknown_protocol_version_rejected(version):
    with pytest.raises(ValidationError) as ei:
        HealthRequest(protocol_version=version)
    assert ei.value.errors()[0]["loc"] == ("protocol_version",)
    assert f"unsupported protocol_version {version}" in str(ei.value)


def test_version_must_be_int_not_str_or_bool():
    for bad in ("1", True, 1.0):
        with pytest.raises(ValidationError):
            HealthRequest(protocol_version=bad)


def test_type_literal_cannot_be_changed():
    with pytest.raises(ValidationError) as ei:
        ExpertEvict(type="expert_fetch", layer=0, expert=0)
    assert ei.value.errors()[0]["loc"] == ("type",)


# --------------------------------------------------------------------------- SamplingParams

BAD_SAMPLING = [
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -math.inf),
    ("temperature", -0.1),
    ("temperature", True),
    ("temperature", "0.7"),
    ("top_k", -1),
    ("top_k", 1_000_001),
    ("top_k", 2.0),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0000001),
    ("top_p", math.nan),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", math.inf),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.nan),
    ("frequency_penalty", -3.0),
    ("frequency_penalty", math.inf),
    ("seed", -1),
    ("seed", 2**63),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 2**31),
    ("max_tokens", 1_000_001),
    ("max_tokens", "16"),
    ("max_tokens", 16.0),
    ("stop", ["x"] * 100_000),
    ("stop", ["x"] * 17),
    ("stop", [""]),
    ("stop", ["y" * 257]),
    ("stop", "END"),
    ("stop", [1]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [2**31]),
    ("stop_token_ids", list(range(65))),
    ("logprobs", 21),
    ("logprobs", -1),
    ("n", 0),
    ("n", 9),
    ("n", 10**6),
    ("n", 2**64),
]


@pytest.mark.parametrize(("field", "value"), BAD_SAMPLING, ids=lambda v: repr(v)[:20])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValidationError) as ei:
        SamplingParams(**{field: value})
    errors = ei.value.errors()
    assert errors and all(e["loc"][0] == field for e in errors)
    assert field in str(ei.value)
    # nested inside a request, the location names the full path
    with pytest.raises(ValidationError) as ei:
        GenerateRequest.model_validate(
            {"request_id": "r", "prompt": "p", "sampling": {field: value}}
        )
    assert ei.value.errors()[0]["loc"][:2] == ("sampling", field)


def test_sampling_edges_that_are_allowed():
    SamplingParams(
        temperature=0, top_k=1_000_000, top_p=1.0, min_p=1.0, repetition_penalty=1e-6,
        presence_penalty=-2, frequency_penalty=2, seed=0, max_tokens=1_000_000,
        stop=["s" * 256] * 16, stop_token_ids=list(range(64)), logprobs=0, n=8,
    )
    assert SamplingParams().temperature == 1.0 and SamplingParams(temperature=0).temperature == 0.0


def test_unknown_sampling_field_rejected():
    with pytest.raises(ValidationError) as ei:
        SamplingParams(best_of=4)
    assert ei.value.errors()[0]["loc"] == ("best_of",)


# --------------------------------------------------------------------------- GenerateRequest

BAD_REQUESTS = [
    ("prompt", {"prompt": ""}),
    ("prompt", {"prompt": "x" * 1_000_001}),
    ("prompt", {"prompt": b"bytes"}),
    ("prompt_token_ids", {"prompt_token_ids": []}),
    ("prompt_token_ids", {"prompt_token_ids": [1, -1, 2]}),
    ("prompt_token_ids", {"prompt_token_ids": [2**31]}),
    ("prompt_token_ids", {"prompt_token_ids": [1.0]}),
    ("prompt_token_ids", {"prompt_token_ids": [True]}),
    ("messages", {"messages": []}),
    ("messages", {"messages": [{"role": "function", "content": "x"}]}),
    ("messages", {"messages": [{"role": "user"}]}),
    ("messages", {"messages": [{"role": "user", "content": "x", "author": "n"}]}),
    ("messages", {"messages": [{"role": "user", "content": "x"}] * 257}),
    ("messages", {"messages": [{"role": "user", "content": "x" * 600_000}] * 2}),
    ("request_id", {"prompt": "p", "request_id": ""}),
    ("request_id", {"prompt": "p", "request_id": "a b"}),
    ("request_id", {"prompt": "p", "request_id": "a/b"}),
    ("request_id", {"prompt": "p", "request_id": "x" * 129}),
    ("request_id", {"prompt": "p", "request_id": 7}),
    ("stream", {"prompt": "p", "stream": "yes"}),
    ("stream", {"prompt": "p", "stream": 1}),
    ("extra", {"prompt": "p", "extra": 1}),
]


@pytest.mark.parametrize(("field", "fields"), BAD_REQUESTS, ids=lambda v: repr(v)[:24])
def test_bad_requests_name_the_field(field, fields):
    body = {"request_id": "r1", **fields}
    with pytest.raises(ValidationError) as ei:
        GenerateRequest.model_validate(body)
    assert ei.value.errors()[0]["loc"][0] == field
    assert field in str(ei.value)


@pytest.mark.parametrize(
    "inputs",
    [
        {},
        {"prompt": "p", "prompt_token_ids": [1]},
        {"prompt": "p", "messages": [{"role": "user", "content": "x"}]},
        {"messages": [{"role": "user", "content": "x"}], "prompt_token_ids": [1]},
    ],
)
def test_exactly_one_prompt_form(inputs):
    with pytest.raises(ValidationError) as ei:
        GenerateRequest.model_validate({"request_id": "r", **inputs})
    assert "exactly one of 'prompt', 'messages' or 'prompt_token_ids'" in str(ei.value)


def test_request_limits_at_the_edge_are_allowed():
    GenerateRequest(request_id="A" * 128, prompt="x" * 1_000_000)
    GenerateRequest(request_id="r", prompt_token_ids=[0] * 1_000_000)
    GenerateRequest(request_id="r", messages=[ChatMessage(role="user", content="y")] * 256)


def test_request_id_pattern_covers_allowed_characters():
    GenerateRequest(request_id="az-AZ_09.:", prompt="p")
    for bad in ("a\n", "é", "a\x00"):
        with pytest.raises(ValidationError):
            GenerateRequest(request_id=bad, prompt="p")


# --------------------------------------------------------------------------- outputs / control


def test_token_chunk_logprobs_must_match_and_be_finite():
    with pytest.raises(ValidationError, match="logprobs has 1 entries but token_ids has 2"):
        TokenChunk(request_id="r", token_ids=[1, 2], text="", logprobs=[-0.1])
    with pytest.raises(ValidationError) as ei:
        TokenChunk(request_id="r", token_ids=[1], text="", logprobs=[math.nan])
    assert ei.value.errors()[0]["loc"][0] == "logprobs"
    with pytest.raises(ValidationError):
        TokenChunk(request_id="r", index=8, token_ids=[], text="")


def test_generate_result_bounds():
    usage = Usage(prompt_tokens=1, completion_tokens=1, prefill_tokens_per_s=1,
                  decode_tokens_per_s=1)
    with pytest.raises(ValidationError) as ei:
        GenerateResult(request_id="r", text="", token_ids=[], finish_reason="eos", usage=usage)
    assert ei.value.errors()[0]["loc"] == ("finish_reason",)
    for field, value in [("prompt_tokens", -1), ("decode_tokens_per_s", math.inf),
                         ("expert_hit_rate", 1.5), ("expert_bytes_per_token", -1.0)]:
        with pytest.raises(ValidationError) as ei:
            Usage(**{**usage.model_dump(), field: value})
        assert ei.value.errors()[0]["loc"] == (field,)


def test_expert_ready_location_is_either_shm_or_handle():
    base = dict(layer=0, expert=0, seq=0, nbytes=10, sha256=SHA, tier="ram")
    for loc in [{}, {"shm_name": "s"}, {"shm_offset": 0},
                {"shm_name": "s", "shm_offset": 0, "handle": "h"}]:
        with pytest.raises(ValidationError):
            ExpertReady(**base, **loc)
    for field, value in [("sha256", "AB" * 32), ("sha256", "ab" * 31), ("tier", "vram"),
                         ("layer", -1), ("expert", 2**16), ("nbytes", 2**41)]:
        with pytest.raises(ValidationError) as ei:
            ExpertReady(**{**base, field: value, "handle": "h"})
        assert ei.value.errors()[0]["loc"][0] == field
    for name in ("../etc/x", "..", "/..", "a/b", ""):
        with pytest.raises(ValidationError):
            ExpertReady(**base, shm_name=name, shm_offset=0)


def test_expert_fetch_and_evict_bounds():
    for kw in [dict(layer=-1, expert=0, seq=0), dict(layer=0, expert=0, seq=-1),
               dict(layer=0, expert=0, seq=0, slot=-3), dict(layer=0, expert=0)]:
        with pytest.raises(ValidationError):
            ExpertFetch(**kw)
    with pytest.raises(ValidationError):
        ExpertEvict(layer=0, expert=True)


def test_health_reply_detail_is_small_and_flat():
    HealthReply(service="decode", ok=False, detail={f"k{i}": i for i in range(64)})
    for detail in [{f"k{i}": i for i in range(65)}, {"a": True}, {"a": [1]}, {"a": {"b": 1}},
                   {"a": math.nan}, {"": 1}, {"a": "x" * 1025}]:
        with pytest.raises(ValidationError) as ei:
            HealthReply(service="decode", ok=True, detail=detail)
        assert ei.value.errors()[0]["loc"][0] == "detail"


# --------------------------------------------------------------------------- errors


def test_error_codes_have_status_and_retryable():
    assert {c.name for c in ErrorCode} == {
        "INVALID_REQUEST", "BUSY", "NOT_FOUND", "PROTOCOL", "ENGINE_DEAD", "EXPERT_LOAD",
        "CAPACITY", "CANCELLED", "TIMEOUT", "INTERNAL",
    }
    expected = {
        ErrorCode.INVALID_REQUEST: (400, False), ErrorCode.BUSY: (503, True),
        ErrorCode.NOT_FOUND: (404, False), ErrorCode.PROTOCOL: (400, False),
        ErrorCode.ENGINE_DEAD: (503, True), ErrorCode.EXPERT_LOAD: (502, True),
        ErrorCode.CAPACITY: (413, False), ErrorCode.CANCELLED: (499, False),
        ErrorCode.TIMEOUT: (504, True), ErrorCode.INTERNAL: (500, False),
    }
    for code, (status, retryable) in expected.items():
        assert (code.http_status, code.retryable) == (status, retryable), code
        assert code.value == code.name.lower() and ErrorCode(code.value) is code


ENGINE_EXPECTED = {
    "RequestValidationError": ErrorCode.INVALID_REQUEST,
    "CapacityError": ErrorCode.CAPACITY,
    "CacheCapacityError": ErrorCode.CAPACITY,
    "ChecksumError": ErrorCode.EXPERT_LOAD,
    "ExpertLoadError": ErrorCode.EXPERT_LOAD,
    "ModelFormatError": ErrorCode.INTERNAL,
    "UnsupportedArchitectureError": ErrorCode.INTERNAL,
    "TokenizerNotFoundError": ErrorCode.INTERNAL,
    "ConfigError": ErrorCode.INTERNAL,
    "MoestreamError": ErrorCode.INTERNAL,
}


def _engine_error_classes():
    return [
        obj for obj in vars(engine_errors).values()
        if inspect.isclass(obj) and issubclass(obj, engine_errors.MoestreamError)
    ]


def test_every_engine_error_is_mapped_on_purpose():
    unmapped = [c.__name__ for c in _engine_error_classes() if c.__name__ not in EXCEPTION_CODES]
    assert not unmapped, f"add these engine errors to protocol.errors.EXCEPTION_CODES: {unmapped}"


@pytest.mark.parametrize("name", sorted(ENGINE_EXPECTED))
def test_engine_errors_map_by_name_class_and_instance(name):
    cls = getattr(engine_errors, name)
    want = ENGINE_EXPECTED[name]
    assert code_for_exception_name(name) is want
    assert code_for_exception_name(f"engine.errors.{name}") is want
    assert code_for_exception_name(cls) is want
    assert code_for_exception(cls.__new__(cls)) is want


def test_engine_error_instances_and_subclasses():
    e = engine_errors.ChecksumError(3, 7, "/store/d0.bin", "a" * 64, "b" * 64)
    assert code_for_exception_name(e) is ErrorCode.EXPERT_LOAD
    reply = ErrorReply.from_exception(e, request_id="r")
    assert reply.code is ErrorCode.EXPERT_LOAD and reply.retryable
    assert "layer 3 expert 7" in reply.message

    class NewEngineError(engine_errors.CapacityError):
        pass

    class Unlisted(engine_errors.MoestreamError, ValueError):
        pass

    assert code_for_exception_name(NewEngineError()) is ErrorCode.CAPACITY
    assert code_for_exception_name(Unlisted("x")) is ErrorCode.INTERNAL  # not INVALID_REQUEST


def test_other_exceptions_map_by_mro_names():
    assert code_for_exception_name(TimeoutError()) is ErrorCode.TIMEOUT
    assert code_for_exception_name(asyncio.TimeoutError()) is ErrorCode.TIMEOUT
    assert code_for_exception_name(asyncio.CancelledError()) is ErrorCode.CANCELLED
    assert code_for_exception_name(asyncio.QueueFull()) is ErrorCode.BUSY
    assert code_for_exception_name(ValueError("x")) is ErrorCode.INTERNAL
    assert code_for_exception_name(KeyError("x")) is ErrorCode.INTERNAL
    assert code_for_exception_name("NoSuchError") is ErrorCode.INTERNAL
    assert code_for_exception_name("RayActorError") is ErrorCode.ENGINE_DEAD
    with pytest.raises(ValidationError) as ei:
        SamplingParams(n=0)
    assert code_for_exception_name(ei.value) is ErrorCode.INVALID_REQUEST
    assert code_for_exception_name(ProtocolError("x", ErrorCode.BUSY)) is ErrorCode.BUSY


def test_protocol_error_from_validation_error_is_bounded_and_readable():
    with pytest.raises(ValidationError) as ei:
        GenerateRequest.model_validate(
            {"request_id": "r", "prompt": "", "sampling": {"stop": ["x"] * 100_000,
                                                           "temperature": math.nan}}
        )
    err = ProtocolError.from_validation_error(ei.value, "generate_request")
    assert err.code is ErrorCode.INVALID_REQUEST and not err.retryable and err.http_status == 400
    locs = [loc for loc, _ in err.field_errors]
    assert {"prompt", "sampling.stop", "sampling.temperature"} <= set(locs)
    assert len(str(err)) < 1000
    assert "sampling.temperature: Input should be a finite number" in str(err)


def test_error_reply_helpers():
    long = ErrorReply.for_code(ErrorCode.INTERNAL, "x" * 10_000)
    assert len(long.message) == 4096 and not long.retryable
    assert ErrorReply.for_code("busy", "full").code is ErrorCode.BUSY
    r = ErrorReply.from_exception(RuntimeError("boom"))
    assert r.code is ErrorCode.INTERNAL and r.request_id is None
    assert r.message == "RuntimeError: boom"
    with pytest.raises(ValidationError):
        ErrorReply(code="nope", message="x", retryable=False)
