"""msgpack codec for wire messages, with tensors as out-of-band buffers.

A message travels as a list of frames (one ZeroMQ multipart message):

    frame 0    msgpack map {"v": PROTOCOL_VERSION, "type": <message type>,
                            "body": message.model_dump(mode="json"),
                            "buffers": [{"dtype": "<f4", "shape": [2, 3], "nbytes": 24}, ...]}
    frame 1..  the raw bytes of each buffer, in order, never copied by this module

Decoding trusts nothing: the header frame has a size cap, msgpack runs with explicit length caps,
no ext types and string map keys only, nesting depth is bounded, the version and type must be
known, every buffer frame must match its descriptor, and the body is validated by the message's
pydantic model. Every failure is a :class:`ProtocolError`; nothing here uses pickle.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Sequence
from typing import Annotated, Any, NamedTuple

import msgpack
from pydantic import Field, ValidationError

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION, StrictModel, WireMessage

__all__ = [
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "BufferDescriptor",
    "Decoded",
    "buffer_as_numpy",
    "decode",
    "decode_frames",
    "encode",
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_MAX_BUFFER_BYTES",
    "DEFAULT_MAX_BUFFERS",
    "DEFAULT_MAX_DEPTH",
]

# Header frame: a 1M-character prompt is <= 4 MB of UTF-8 and 1M token ids <= 5 MB of msgpack.
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_BUFFER_BYTES = 2 * 1024**3  # per out-of-band buffer
DEFAULT_MAX_BUFFERS = 64
DEFAULT_MAX_DEPTH = 16  # real headers nest 5 deep (header.body.messages[i].content)
MAX_ARRAY_LEN = 1_000_000  # the longest list any message allows (prompt_token_ids)
MAX_MAP_LEN = 256
# Bounds on what one header may allocate, whatever its byte size: a 16 MiB frame of empty maps
# would otherwise become 16M dicts (~1 GiB). Real headers hold a few dozen containers.
MAX_CONTAINERS = 4096
MAX_TOTAL_ITEMS = MAX_ARRAY_LEN + 65_536
MAX_DIMS = 32

_HEADER_KEYS = frozenset({"v", "type", "body", "buffers"})
# numpy typestr ("<f4", "|u1", "|b1", "|V12") or a single struct format code ("B", "f", "<i").
_TYPESTR = re.compile(r"^[<>|=]?[biufcSV]([1-9][0-9]{0,5})$")


class BufferDescriptor(StrictModel):
    """What one out-of-band buffer frame holds; lets the receiver view it as an array."""

    dtype: str = Field(
        min_length=1,
        max_length=16,
        description="Element type: a numpy typestr such as '<f4' or a struct format such as 'B'.",
    )
    shape: list[Annotated[int, Field(ge=0, le=2**62)]] = Field(
        max_length=MAX_DIMS, description="Array shape; [] for a scalar."
    )
    nbytes: int = Field(ge=0, le=2**62, description="Exact length of the buffer frame in bytes.")


class Decoded(NamedTuple):
    message: WireMessage
    buffers: list[memoryview]
    descriptors: list[BufferDescriptor]


def itemsize(dtype: str) -> int | None:
    """Bytes per element of a numpy typestr or struct format, or None if not understood."""
    m = _TYPESTR.match(dtype)
    if m:
        return int(m.group(1))
    if len(dtype) <= 2:
        try:
            size = struct.calcsize(dtype)
        except struct.error:
            return None
        return size if size > 0 else None
    return None


# --------------------------------------------------------------------------- encode


def encode(message: WireMessage, buffers: Sequence[Any] = ()) -> list[bytes | memoryview]:
    """Frames for ``message`` plus out-of-band ``buffers`` (numpy arrays or any C-contiguous
    object with the buffer protocol). Buffer frames are memoryviews of the inputs, not copies:
    keep the inputs alive and unchanged until the frames are sent.
    """
    type_name = getattr(message, "type", None)
    if not isinstance(message, WireMessage) or MESSAGE_TYPES.get(type_name) is not type(message):
        raise TypeError(f"not a registered wire message: {type(message).__name__}")
    views: list[memoryview] = []
    descriptors: list[dict[str, Any]] = []
    for i, buf in enumerate(buffers):
        try:
            mv = memoryview(buf)
        except TypeError:
            raise TypeError(
                f"buffer {i} ({type(buf).__name__}) does not support the buffer protocol"
            ) from None
        if not mv.c_contiguous:
            raise ValueError(
                f"buffer {i} is not C-contiguous; pass numpy.ascontiguousarray(...) instead"
            )
        dtype = getattr(getattr(buf, "dtype", None), "str", None) or mv.format
        size = itemsize(dtype)
        if size is None or size * math.prod(mv.shape) != mv.nbytes:
            raise ValueError(
                f"buffer {i} has an element type the protocol cannot describe: {dtype!r}"
            )
        views.append(mv.cast("B") if mv.nbytes else memoryview(b""))
        descriptors.append({"dtype": dtype, "shape": list(mv.shape), "nbytes": mv.nbytes})
    header = {
        "v": PROTOCOL_VERSION,
        "type": type_name,
        "body": message.model_dump(mode="json"),
        "buffers": descriptors,
    }
    return [msgpack.packb(header, use_bin_type=True), *views]


# --------------------------------------------------------------------------- decode


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not allowed in a header frame")


class _Budget:
    """msgpack list/object hooks that count containers and their items as they are built,
    so an allocation bomb stops after a bounded amount of work instead of after the frame."""

    def __init__(self) -> None:
        self.containers = 0
        self.items = 0

    def _charge(self, obj: Any) -> Any:
        self.containers += 1
        self.items += len(obj)
        if self.containers > MAX_CONTAINERS:
            raise ProtocolError(f"header holds more than {MAX_CONTAINERS} arrays and maps")
        if self.items > MAX_TOTAL_ITEMS:
            raise ProtocolError(f"header holds more than {MAX_TOTAL_ITEMS} array/map items")
        return obj

    list_hook = object_hook = _charge


def _check_depth(obj: Any, max_depth: int) -> None:
    # Iterative: the whole point is to not recurse on attacker-controlled nesting.
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise ProtocolError(f"header nests deeper than {max_depth} levels")
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _unpack_header(frame: Any, max_frame_bytes: int, max_depth: int) -> dict[str, Any]:
    try:
        data = memoryview(frame)
    except TypeError:
        raise ProtocolError(f"frame 0 is a {type(frame).__name__}, not bytes") from None
    if data.nbytes > max_frame_bytes:
        raise ProtocolError(f"header frame is {data.nbytes} bytes; the limit is {max_frame_bytes}")
    if data.nbytes == 0:
        raise ProtocolError("header frame is empty")
    # msgpack.unpackb has no max_buffer_size (only Unpacker does): the size check above is it.
    budget = _Budget()
    try:
        header = msgpack.unpackb(
            data,
            list_hook=budget.list_hook,
            object_hook=budget.object_hook,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_reject_ext,
            max_str_len=max_frame_bytes,
            max_bin_len=0,  # a header never holds bytes; data rides in buffer frames
            max_ext_len=0,  # no ext types at all (also rules out the built-in timestamp)
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
        )
    except ProtocolError:
        raise
    except msgpack.StackError:
        raise ProtocolError("header frame nests too deeply for msgpack") from None
    except msgpack.ExtraData:
        raise ProtocolError("header frame has bytes after the msgpack object") from None
    except Exception as e:  # FormatError, ValueError (limits, truncation), UnicodeDecodeError
        why = str(e)[:200] or type(e).__name__
        if "max_ext_len" in why:
            why = "msgpack ext types are not allowed in a header frame"
        elif "max_bin_len" in why:
            why = "binary data is not allowed in a header frame (send it as a buffer frame)"
        raise ProtocolError(f"header frame is not valid msgpack: {why}") from None
    if budget.containers > max_depth:  # depth <= container count: most headers skip the walk
        _check_depth(header, max_depth)
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, not {type(header).__name__}")
    return header


def decode_frames(
    frames: Sequence[Any],
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
    max_buffers: int = DEFAULT_MAX_BUFFERS,
    max_depth: int = DEFAULT_MAX_DEPTH,
    expect: type[WireMessage] | tuple[type[WireMessage], ...] | None = None,
) -> Decoded:
    """Decode frames made by :func:`encode`; also returns the buffers' descriptors.

    ``max_frame_bytes`` caps the header frame, ``max_buffer_bytes`` each buffer frame.
    ``expect`` restricts which message classes are acceptable on this socket.
    Raises ProtocolError: code PROTOCOL for a bad frame, INVALID_REQUEST for a body that fails
    validation (``field_errors`` lists each bad field).
    """
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ProtocolError("expected a non-empty list of frames")
    if len(frames) - 1 > max_buffers:
        raise ProtocolError(f"{len(frames) - 1} buffer frames; the limit is {max_buffers}")
    header = _unpack_header(frames[0], max_frame_bytes, max_depth)

    if "v" not in header:
        raise ProtocolError("header has no protocol version 'v'")
    version = header["v"]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {version!r}; this build speaks {PROTOCOL_VERSION}"
        )
    extra = set(header) - _HEADER_KEYS
    if extra:
        raise ProtocolError(f"unknown header keys: {sorted(map(str, extra))[:8]}")
    type_name = header.get("type")
    cls = MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ProtocolError(
            f"unknown message type {str(type_name)[:64]!r}; known: {', '.join(MESSAGE_TYPES)}"
        )
    if expect is not None and not issubclass(cls, expect):
        raise ProtocolError(f"unexpected message type {type_name!r} on this channel")

    views, descriptors = _check_buffers(header.get("buffers", []), frames[1:], max_buffer_bytes)

    body = header.get("body")
    if not isinstance(body, dict):
        raise ProtocolError(f"header body must be a map, not {type(body).__name__}")
    if body.get("type", type_name) != type_name:
        raise ProtocolError(f"body type {str(body['type'])[:64]!r} != header type {type_name!r}")
    if body.get("protocol_version", version) != version:
        raise ProtocolError(
            f"body protocol_version {body['protocol_version']!r} != header version {version}"
        )
    try:
        message = cls.model_validate(body)
    except ValidationError as e:
        raise ProtocolError.from_validation_error(e, type_name) from None
    return Decoded(message, views, descriptors)


def decode(
    frames: Sequence[Any],
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
    max_buffers: int = DEFAULT_MAX_BUFFERS,
    max_depth: int = DEFAULT_MAX_DEPTH,
    expect: type[WireMessage] | tuple[type[WireMessage], ...] | None = None,
) -> tuple[WireMessage, list[memoryview]]:
    """Decode frames into ``(message, buffers)``; see :func:`decode_frames`, which also
    returns each buffer's dtype and shape."""
    message, views, _ = decode_frames(
        frames,
        max_frame_bytes=max_frame_bytes,
        max_buffer_bytes=max_buffer_bytes,
        max_buffers=max_buffers,
        max_depth=max_depth,
        expect=expect,
    )
    return message, views


def _check_buffers(
    raw_descriptors: Any, frames: Sequence[Any], max_buffer_bytes: int
) -> tuple[list[memoryview], list[BufferDescriptor]]:
    if not isinstance(raw_descriptors, list):
        raise ProtocolError("header 'buffers' must be a list of descriptors")
    if len(raw_descriptors) != len(frames):
        raise ProtocolError(
            f"header describes {len(raw_descriptors)} buffers but {len(frames)} buffer frames came"
        )
    views, descriptors = [], []
    for i, (raw, frame) in enumerate(zip(raw_descriptors, frames)):
        try:
            desc = BufferDescriptor.model_validate(raw)
        except ValidationError as e:
            raise ProtocolError.from_validation_error(
                e, f"buffer descriptor {i}", ErrorCode.PROTOCOL
            ) from None
        size = itemsize(desc.dtype)
        if size is None:
            raise ProtocolError(f"buffer {i} has unknown dtype {desc.dtype!r}")
        if size * math.prod(desc.shape) != desc.nbytes:
            raise ProtocolError(
                f"buffer {i} descriptor is inconsistent: shape {desc.shape} of {desc.dtype} "
                f"is not {desc.nbytes} bytes"
            )
        try:
            mv = memoryview(frame)
        except TypeError:
            what = type(frame).__name__
            raise ProtocolError(f"buffer frame {i} is a {what}, not bytes") from None
        if mv.nbytes > max_buffer_bytes:
            raise ProtocolError(
                f"buffer frame {i} is {mv.nbytes} bytes; the limit is {max_buffer_bytes}"
            )
        if mv.nbytes != desc.nbytes:
            raise ProtocolError(
                f"buffer frame {i} is {mv.nbytes} bytes but its descriptor says {desc.nbytes}"
            )
        if mv.format != "B" or mv.ndim != 1:
            if not mv.c_contiguous:
                raise ProtocolError(f"buffer frame {i} is not contiguous")
            mv = mv.cast("B") if mv.nbytes else memoryview(b"")
        views.append(mv)
        descriptors.append(desc)
    return views, descriptors


def buffer_as_numpy(view: memoryview, descriptor: BufferDescriptor) -> Any:
    """A numpy array over ``view`` (no copy), typed and shaped by its descriptor.

    numpy is imported here, not at module import: protocol itself does not need it.
    """
    import numpy as np

    return np.frombuffer(view, dtype=np.dtype(descriptor.dtype)).reshape(descriptor.shape)
