"""Packing a step's messages into StepFrames that every receiver's decoder accepts.

One engine step of many requests is normally one StepFrame. The codec bounds what one header
may hold (containers, items, bytes: protocol.codec), and a step of many requests with top
logprobs, or of several long requests ending together, can go past those bounds; such a step
is cut into consecutive frames, each within half of every bound. The cost of a message is
counted from its fields (an over-estimate), without encoding it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from protocol.codec import DEFAULT_MAX_FRAME_BYTES, MAX_CONTAINERS, MAX_TOTAL_ITEMS
from protocol.messages import MAX_STEP_MESSAGES, ErrorReply, GenerateResult, StepFrame, TokenChunk

# what one frame may use: half of each decoder bound, for the frame's own header and the
# estimate's slack
FRAME_CONTAINERS = MAX_CONTAINERS // 2
FRAME_ITEMS = MAX_TOTAL_ITEMS // 2
FRAME_BYTES = DEFAULT_MAX_FRAME_BYTES // 2
_FIELD_BYTES = 16  # per msgpack item: a float is 9 bytes, an int <= 5, a short key about 12
_MESSAGE_BYTES = 256  # field names and fixed fields of one message body


def message_cost(msg: TokenChunk | GenerateResult | ErrorReply) -> tuple[int, int, int]:
    """(containers, items, bytes) that ``msg`` adds to a StepFrame header, over-estimated."""
    containers, items = 1, 12  # the body map and its fields
    nbytes = _MESSAGE_BYTES
    if isinstance(msg, (TokenChunk, GenerateResult)):
        n = len(msg.token_ids)
        containers += 1
        items += n
        nbytes += 4 * (len(msg.text) + len(msg.reasoning or ""))
    if isinstance(msg, TokenChunk):
        if msg.logprobs is not None:
            containers, items = containers + 1, items + len(msg.logprobs)
        if msg.top_logprobs is not None:
            alternatives = sum(len(t) for t in msg.top_logprobs)
            containers += 1 + len(msg.top_logprobs) + alternatives
            items += len(msg.top_logprobs) + 3 * alternatives  # list entry + 2 keys each
    elif isinstance(msg, GenerateResult):
        containers, items = containers + 1, items + 12  # usage
    elif isinstance(msg, ErrorReply):
        nbytes += 4 * len(msg.message)
    return containers, items, nbytes + _FIELD_BYTES * items


def step_frames(messages: Iterable[TokenChunk | GenerateResult | ErrorReply], seq: int,
                ended: Iterable[str] = ()) -> Iterator[StepFrame]:
    """``messages`` in order, then ``ended`` (the requests whose streams are over), as
    StepFrames numbered from ``seq``; at least one frame (an empty one when there is nothing).
    A message too big for a frame of its own still gets one: the receiver's decoder judges it,
    as it would judge the message alone."""
    batch: list = []
    used = [0, 0, 0]
    for msg in messages:
        cost = message_cost(msg)
        full = any(u + c > cap for u, c, cap in zip(used, cost, (FRAME_CONTAINERS, FRAME_ITEMS,
                                                                 FRAME_BYTES)))
        if batch and (full or len(batch) == MAX_STEP_MESSAGES):
            yield StepFrame(seq=seq, messages=batch)
            seq, batch, used = seq + 1, [], [0, 0, 0]
        batch.append(msg)
        used = [u + c for u, c in zip(used, cost)]
    ended = list(ended)
    # the ids ride on the last frame (each <= 128 ASCII characters: far within the bounds)
    room = MAX_STEP_MESSAGES if used[2] + 160 * len(ended) <= FRAME_BYTES else 0
    yield StepFrame(seq=seq, messages=batch, ended=ended[:room])
    for i in range(room, len(ended), MAX_STEP_MESSAGES):
        seq += 1
        yield StepFrame(seq=seq, messages=[], ended=ended[i:i + MAX_STEP_MESSAGES])
