"""moestream's wire contract: message models, the msgpack codec and error codes.

Imports neither torch, ray nor engine, so clients and tests can use it cheaply.
"""

from protocol.codec import (
    BufferDescriptor,
    Decoded,
    buffer_as_numpy,
    decode,
    decode_frames,
    encode,
)
from protocol.errors import (
    ErrorCode,
    ProtocolError,
    code_for_exception,
    code_for_exception_name,
)
from protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ChatMessage,
    ErrorReply,
    ExpertEvict,
    ExpertFetch,
    ExpertReady,
    GenerateRequest,
    GenerateResult,
    HealthReply,
    HealthRequest,
    SamplingParams,
    StepFrame,
    TokenChunk,
    Usage,
    WireMessage,
)

__all__ = [
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "BufferDescriptor",
    "ChatMessage",
    "Decoded",
    "ErrorCode",
    "ErrorReply",
    "ExpertEvict",
    "ExpertFetch",
    "ExpertReady",
    "GenerateRequest",
    "GenerateResult",
    "HealthReply",
    "HealthRequest",
    "ProtocolError",
    "SamplingParams",
    "StepFrame",
    "TokenChunk",
    "Usage",
    "WireMessage",
    "buffer_as_numpy",
    "code_for_exception",
    "code_for_exception_name",
    "decode",
    "decode_frames",
    "encode",
]
