"""The wire messages: what clients send and receive, and the small control messages between actors.

Every message derives from :class:`WireMessage`: it carries ``protocol_version`` and a ``type``
literal, is frozen, validates strictly (no str -> int coercion, no bools as numbers, no NaN or
inf), and forbids unknown fields. Tensors never travel inside a message: they ride as
out-of-band buffers next to it (protocol.codec), and expert bytes go through shared memory.

The bounds below are the protocol's hard limits, independent of any model: they keep a hostile
or broken client from making the engine allocate without bound (reliability checklist 16-20).
Limits that depend on the model (vocabulary size, context length) are checked by the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from protocol.errors import ErrorCode, code_for_exception_name

PROTOCOL_VERSION = 1

MAX_PROMPT_CHARS = 1_000_000
MAX_PROMPT_TOKENS = 1_000_000
MAX_NEW_TOKENS = 1_000_000
DEFAULT_MAX_TOKENS = 256  # when a request gives no max_tokens
MAX_TOKEN_ID = 2**31 - 1  # the engine checks ids against the vocabulary; this keeps int32 safe
MAX_CHAT_MESSAGES = 256
MAX_N = 8
MAX_DRAFT_TOKENS = 16  # speculative draft tokens per verification step
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_TOOLS = 128  # tools offered in one request
MAX_TOOL_CALLS = 64  # tool calls in one assistant turn
MAX_NAME_CHARS = 256  # a tool's or a message author's name
MAX_SCHEMA_CHARS = 1_000_000  # a JSON schema or grammar, as text
MAX_TOP_K = 1_000_000
MAX_SEED = 2**63 - 1
MAX_ERROR_MESSAGE_CHARS = 4096
MAX_LAYER = 2**16 - 1
MAX_EXPERT = 2**16 - 1
MAX_SLOT = 2**31 - 1
MAX_SEQ = 2**63 - 1
MAX_EXPERT_NBYTES = 2**40
MAX_HEALTH_DETAIL_ITEMS = 64

REQUEST_ID_PATTERN = r"^[A-Za-z0-9_.:-]+$"

MAX_REPORTED_ITEMS = 4  # bad items a list error names; the rest are only counted

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
RequestId = Annotated[str, Field(min_length=1, max_length=128, pattern=REQUEST_ID_PATTERN)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


def _item_repr(x: Any) -> str:
    """A bad item as an error names it: short, and never the item's contents when it is big."""
    if isinstance(x, int) and x.bit_length() > 64:
        return f"<{x.bit_length()}-bit integer>"
    text = repr(x) if isinstance(x, (int, float)) else type(x).__name__
    return text if len(text) <= 24 else text[:21] + "..."


def bounded_items(what: str, ok: Callable[[Any], bool], allowed: str) -> WrapValidator:
    """Check a list's items in one pass before pydantic validates it item by item. More than
    MAX_REPORTED_ITEMS bad items give one error naming the first few and the count: a list of
    10^6 bad items costs one error, not 10^6 (pydantic builds an error object per item, ~1 GB).
    Fewer get pydantic's own per-item errors. ``ok`` must accept exactly what the item type
    accepts; what it lets through, pydantic still checks."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, list) and len(value) <= MAX_LIST_ITEMS:  # longer: too_long error
            first: list[str] = []
            count = 0
            for i, x in enumerate(value):
                if not ok(x):
                    count += 1
                    if len(first) < MAX_REPORTED_ITEMS:
                        first.append(f"[{i}]={_item_repr(x)}")
            if count > MAX_REPORTED_ITEMS:  # fewer: pydantic's own errors, one per item
                raise PydanticCustomError(
                    "invalid_items",
                    "{count} of {total} {what} are not {allowed}; first: {first}",
                    {"count": count, "total": len(value), "what": what, "allowed": allowed,
                     "first": ", ".join(first)},
                )
        return handler(value)

    return WrapValidator(check)


def _is_token_id(x: Any) -> bool:
    return type(x) is int and 0 <= x <= MAX_TOKEN_ID  # bool and float are not token ids


def _is_finite_number(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


MAX_LIST_ITEMS = max(MAX_PROMPT_TOKENS, MAX_NEW_TOKENS)
TokenIds = Annotated[
    list[TokenId], bounded_items("token ids", _is_token_id, f"integers in [0, {MAX_TOKEN_ID}]")
]
FiniteFloats = Annotated[
    list[FiniteFloat], bounded_items("values", _is_finite_number, "finite numbers")
]


class StrictModel(BaseModel):
    """Strict, closed, immutable: the configuration every protocol model shares."""

    model_config = ConfigDict(
        strict=True, extra="forbid", frozen=True, allow_inf_nan=False, validate_default=False
    )


class WireMessage(StrictModel):
    """Base of every message that travels on its own. Subclasses set a ``type`` literal."""

    protocol_version: int = Field(
        PROTOCOL_VERSION,
        description=f"Version of the wire protocol the sender speaks; this build speaks "
        f"{PROTOCOL_VERSION} and rejects any other.",
    )

    @field_validator("protocol_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != PROTOCOL_VERSION:
            raise ValueError(
                f"unsupported protocol_version {v}; this build speaks {PROTOCOL_VERSION}"
            )
        return v


# --------------------------------------------------------------------------- client-facing


class GrammarSpec(StrictModel):
    """A constraint on the output, enforced token by token in the sampler (engine.agent.grammar).
    The router derives it from ``response_format`` and ``tool_choice``; clients do not send it."""

    kind: Literal["json_object", "json_schema", "ebnf", "structural_tag"] = Field(
        description="json_object: any JSON object; json_schema: ``text`` is a JSON schema; ebnf: "
        "``text`` is a GBNF/EBNF grammar whose start rule is ``root``; structural_tag: ``text`` is "
        "an xgrammar structural tag (JSON).")
    text: str = Field("", max_length=MAX_SCHEMA_CHARS, description="The schema or grammar text.")


class SamplingParams(StrictModel):
    """How to pick each next token. Defaults give plain sampling at temperature 1."""

    temperature: float = Field(
        1.0, ge=0.0, description="Softmax temperature, finite and >= 0; 0 means greedy decoding."
    )
    top_k: int = Field(
        0,
        ge=0,
        le=MAX_TOP_K,
        description=f"Keep only the k most likely tokens; 0 turns it off, else 1..{MAX_TOP_K}.",
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling: keep the smallest set of tokens whose probability "
        "reaches top_p; in (0, 1], 1 turns it off.",
    )
    min_p: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Drop tokens whose probability is below min_p times the most likely "
        "token's; in [0, 1], 0 turns it off.",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        description="Multiplicative penalty on tokens already seen (prompt and output); "
        "finite and > 0, 1 turns it off.",
    )
    presence_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Subtracted from the logit of every token already generated; in [-2, 2].",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Subtracted from a token's logit once per time it was generated; in [-2, 2].",
    )
    seed: int | None = Field(
        None,
        ge=0,
        le=MAX_SEED,
        description="Random seed for this request (0..2^63-1); the same seed gives the same "
        "tokens alone or in a batch. None draws one.",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_NEW_TOKENS,
        description=f"Most tokens to generate, 1..{MAX_NEW_TOKENS}; the engine rejects prompt + "
        f"max_tokens beyond the model's context. None: {DEFAULT_MAX_TOKENS}, lowered by the router "
        "to what the context leaves after the prompt.",
    )
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list,
        max_length=MAX_STOP_STRINGS,
        description=f"Stop when the output ends with any of these strings (at most "
        f"{MAX_STOP_STRINGS}, each 1..{MAX_STOP_CHARS} characters); the stop string is not "
        "returned.",
    )
    stop_token_ids: TokenIds = Field(
        default_factory=list,
        max_length=MAX_STOP_TOKEN_IDS,
        description=f"Stop after generating any of these token ids (at most "
        f"{MAX_STOP_TOKEN_IDS}); the model's end-of-sequence tokens always stop.",
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description=f"Return the log-probability of each sampled token (0..{MAX_LOGPROBS} "
        "alternatives requested); None returns none.",
    )
    n: int = Field(
        1, ge=1, le=MAX_N, description=f"How many completions to generate, 1..{MAX_N}."
    )
    speculative: bool | None = Field(
        None,
        description="Speculative decoding for this request: true or false; None takes the "
        "server's default. Which drafter runs is the server's choice (`moestream serve "
        "--speculative`); output is identical in distribution either way (greedy: identical).",
    )
    num_speculative_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_DRAFT_TOKENS,
        description=f"Most draft tokens verified per step, 1..{MAX_DRAFT_TOKENS}; None takes the "
        "server's default (adaptive).",
    )
    grammar: GrammarSpec | None = Field(
        None,
        description="Constrain the output to this grammar (structured output, forced tool calls); "
        "None: unconstrained. A constrained request does not speculate.",
    )


class ToolCall(StrictModel):
    """One function call the assistant made (in a request's history, or in a result)."""

    id: str = Field(min_length=1, max_length=MAX_NAME_CHARS, description="The call's id; a tool "
                    "message answers it by this id.")
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, description="The function's name.")
    arguments: str = Field(max_length=MAX_PROMPT_CHARS, description="The arguments as JSON text "
                           "(an object when the model wrote valid JSON).")


class ToolCallDelta(StrictModel):
    """A streamed piece of a tool call: the first piece of call ``index`` has its id and name,
    later pieces append to its arguments text."""

    index: int = Field(ge=0, le=MAX_TOOL_CALLS, description="Which call of this answer (0-based).")
    id: str | None = Field(None, max_length=MAX_NAME_CHARS, description="Set on the call's first piece.")
    name: str | None = Field(None, max_length=MAX_NAME_CHARS, description="Set on the call's first piece.")
    arguments: str = Field("", max_length=MAX_PROMPT_CHARS, description="Arguments text added.")


class ToolSpec(StrictModel):
    """A function the model may call."""

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[A-Za-z0-9_.:-]+$",
                      description="The function's name: letters, digits, _ . : -")
    description: str = Field("", max_length=MAX_PROMPT_CHARS, description="What it does.")
    parameters: str = Field('{"type": "object", "properties": {}}', max_length=MAX_SCHEMA_CHARS,
                            description="JSON schema of its arguments, as JSON text.")
    strict: bool = Field(False, description="Arguments must follow the schema (OpenAI's strict).")


class ResponseFormat(StrictModel):
    """The shape of the answer: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"] = Field(description="The format.")
    schema_text: str | None = Field(None, max_length=MAX_SCHEMA_CHARS, description="json_schema: "
                                    "the JSON schema as JSON text.")
    name: str | None = Field(None, max_length=MAX_NAME_CHARS, description="json_schema: its name.")
    strict: bool = Field(True, description="json_schema: enforce the schema (always enforced here).")


class ChatMessage(StrictModel):
    """One turn of a chat; the tokenizer's chat template renders the list into a prompt."""

    role: Literal["system", "user", "assistant", "tool"] = Field(
        description="Who speaks: system, user, assistant, or tool (a tool call's result)."
    )
    content: str = Field(
        max_length=MAX_PROMPT_CHARS, description="The text of the turn (may be empty)."
    )
    tool_calls: list[ToolCall] | None = Field(
        None, max_length=MAX_TOOL_CALLS, description="assistant: the calls it made."
    )
    tool_call_id: str | None = Field(
        None, max_length=MAX_NAME_CHARS, description="tool: the id of the call this answers."
    )
    name: str | None = Field(
        None, max_length=MAX_NAME_CHARS, description="tool: the function's name (optional)."
    )
    reasoning: str | None = Field(
        None, max_length=MAX_PROMPT_CHARS, description="assistant: its reasoning text, given to "
        "templates that render it (as ``reasoning_content``)."
    )


class GenerateRequest(WireMessage):
    """Generate text. Give exactly one of ``prompt``, ``messages`` or ``prompt_token_ids``."""

    type: Literal["generate_request"] = Field(
        "generate_request", description="Message type discriminator."
    )
    request_id: RequestId = Field(
        description="Caller-chosen id, unique among in-flight requests: 1..128 characters "
        "of A-Z a-z 0-9 _ . : -"
    )
    prompt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_PROMPT_CHARS,
        description=f"Raw prompt text, 1..{MAX_PROMPT_CHARS} characters.",
    )
    messages: list[ChatMessage] | None = Field(
        None,
        min_length=1,
        max_length=MAX_CHAT_MESSAGES,
        description=f"Chat turns (1..{MAX_CHAT_MESSAGES}), rendered with the model's chat "
        f"template; their content totals at most {MAX_PROMPT_CHARS} characters.",
    )
    prompt_token_ids: TokenIds | None = Field(
        None,
        min_length=1,
        max_length=MAX_PROMPT_TOKENS,
        description=f"Pre-tokenized prompt, 1..{MAX_PROMPT_TOKENS} non-negative ids; the "
        "engine rejects ids outside the vocabulary.",
    )
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None,
        description="With messages: passed to the chat template as `reasoning_effort` (gpt-oss's "
        "template writes it into the system message; templates that do not use it ignore it). "
        "None: the template's default.",
    )
    sampling: SamplingParams = Field(
        default_factory=SamplingParams, description="Sampling parameters."
    )
    stream: bool = Field(
        False, description="Stream TokenChunk messages as tokens are produced, then the result."
    )
    enable_thinking: bool | None = Field(
        None, description="With messages: passed to the chat template as `enable_thinking` "
        "(Qwen3's templates think unless it is false). None: the template's default."
    )
    tools: list[ToolSpec] | None = Field(
        None, max_length=MAX_TOOLS, description="With messages: functions the model may call, "
        "rendered by the chat template; its calls come back as tool_calls."
    )
    tool_choice: Literal["auto", "none", "required", "function"] = Field(
        "auto", description="auto: the model decides; none: no calls (tools are not rendered); "
        "required: at least one call; function: a call of `tool_name`. required and function "
        "are enforced by a grammar."
    )
    tool_name: str | None = Field(
        None, max_length=MAX_NAME_CHARS, description="tool_choice 'function': the tool to call."
    )
    parallel_tool_calls: bool = Field(
        True, description="False: at most one call per answer (enforced under required/function)."
    )
    response_format: ResponseFormat | None = Field(
        None, description="With messages or a prompt: the answer's format, enforced by a grammar."
    )

    @field_validator("messages")
    @classmethod
    def _bounded_chat(cls, v: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if v is not None:
            total = sum(len(m.content) for m in v)
            if total > MAX_PROMPT_CHARS:
                raise ValueError(
                    f"chat content totals {total} characters; at most {MAX_PROMPT_CHARS}"
                )
        return v

    @model_validator(mode="after")
    def _exactly_one_input(self) -> GenerateRequest:
        given = [
            name
            for name in ("prompt", "messages", "prompt_token_ids")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "exactly one of 'prompt', 'messages' or 'prompt_token_ids' must be given; got "
                + (" and ".join(repr(g) for g in given) if given else "none")
            )
        if self.tool_choice == "function":
            names = [t.name for t in self.tools or ()]
            if self.tool_name not in names:
                raise ValueError(f"tool_choice names {self.tool_name!r}, which is not among the "
                                 f"tools given: {names[:8]}")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs at least one tool")
        if self.tools and self.messages is None:
            raise ValueError("tools need chat messages (a chat template renders them)")
        return self


class TopLogprob(StrictModel):
    """One alternative token at a position and its log-probability."""

    token_id: TokenId = Field(description="The alternative token's id.")
    logprob: FiniteFloat = Field(description="Its log-probability at that position.")


class TokenChunk(WireMessage):
    """Tokens streamed for one completion of a request (only when ``stream`` is set)."""

    type: Literal["token_chunk"] = Field("token_chunk", description="Message type discriminator.")
    request_id: RequestId = Field(description="The request these tokens belong to.")
    index: int = Field(
        0, ge=0, lt=MAX_N, description="Which of the request's n completions (0..n-1)."
    )
    token_ids: TokenIds = Field(
        max_length=MAX_NEW_TOKENS, description="Token ids produced since the previous chunk."
    )
    text: str = Field(
        description="Text decoded since the previous chunk; may be empty while a multi-byte "
        "character is incomplete."
    )
    reasoning: str | None = Field(
        None,
        description="For models with reasoning (gpt-oss's analysis channel, <think>...</think>): "
        "reasoning text decoded since the previous chunk (``text`` is then the answer only); "
        "None for models without reasoning.",
    )
    tool_calls: list[ToolCallDelta] | None = Field(
        None, max_length=MAX_TOOL_CALLS, description="Tool-call pieces parsed since the previous "
        "chunk (requests with tools); None: none."
    )
    logprobs: FiniteFloats | None = Field(
        None,
        max_length=MAX_NEW_TOKENS,
        description="Log-probability of each token in token_ids (same length), when the "
        "request asked for logprobs.",
    )
    top_logprobs: list[Annotated[list[TopLogprob], Field(max_length=MAX_LOGPROBS)]] | None = Field(
        None,
        max_length=MAX_NEW_TOKENS,
        description=f"For each token in token_ids (same length), the most likely alternatives "
        f"at its position, most likely first, when the request asked for logprobs > 0 (at most "
        f"{MAX_LOGPROBS} each).",
    )

    @model_validator(mode="after")
    def _logprobs_match(self) -> TokenChunk:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} entries but token_ids has "
                f"{len(self.token_ids)}; they must match"
            )
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.token_ids):
            raise ValueError(
                f"top_logprobs has {len(self.top_logprobs)} entries but token_ids has "
                f"{len(self.token_ids)}; they must match"
            )
        return self


class Usage(StrictModel):
    """Token counts and speeds of one request (the benchmark's figures, per request)."""

    prompt_tokens: int = Field(ge=0, description="Tokens in the prompt.")
    completion_tokens: int = Field(ge=0, description="Tokens generated.")
    prefill_tokens_per_s: float = Field(ge=0.0, description="Prompt tokens processed per second.")
    decode_tokens_per_s: float = Field(ge=0.0, description="Tokens generated per second.")
    expert_hit_rate: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Fraction of routed-expert lookups served from the device cache, in [0, 1].",
    )
    expert_bytes_per_token: float | None = Field(
        None, ge=0.0, description="Expert bytes moved to the device per generated token."
    )
    draft_tokens: int | None = Field(
        None, ge=0, description="Speculative draft tokens proposed for this request (None: off)."
    )
    accepted_draft_tokens: int | None = Field(
        None, ge=0, description="Of draft_tokens, how many the target model accepted."
    )
    cached_tokens: int | None = Field(
        None,
        ge=0,
        description="Prompt tokens reused from the prefix cache (not computed); None: unknown.",
    )


class GenerateResult(WireMessage):
    """The final answer for one completion of a request."""

    type: Literal["generate_result"] = Field(
        "generate_result", description="Message type discriminator."
    )
    request_id: RequestId = Field(description="The request this answers.")
    index: int = Field(
        0, ge=0, lt=MAX_N, description="Which of the request's n completions (0..n-1)."
    )
    text: str = Field(description="The generated text, without any stop string.")
    reasoning: str | None = Field(
        None,
        description="For models with reasoning (gpt-oss's analysis channel, <think>...</think>): "
        "the reasoning text, ``text`` being the answer; None for models without reasoning.",
    )
    tool_calls: list[ToolCall] | None = Field(
        None, max_length=MAX_TOOL_CALLS, description="The tool calls parsed from the output "
        "(requests with tools); None: none."
    )
    token_ids: TokenIds = Field(
        max_length=MAX_NEW_TOKENS, description="The generated token ids."
    )
    finish_reason: Literal["stop", "length", "abort", "error"] = Field(
        description="stop: end-of-sequence or a stop string/token; length: max_tokens or the "
        "context reached; abort: cancelled; error: see the ErrorReply sent with it."
    )
    stop_sequence: str | None = Field(
        None, max_length=MAX_STOP_CHARS, description="The stop string that ended the text "
        "(finish_reason stop); None when none did (end-of-sequence, a stop token, a limit)."
    )
    usage: Usage = Field(description="Token counts and speeds.")


class ErrorReply(WireMessage):
    """A request, or a frame, failed; ``code`` says how and whether retrying may help."""

    type: Literal["error_reply"] = Field("error_reply", description="Message type discriminator.")
    request_id: RequestId | None = Field(
        None, description="The failed request, when it is known (absent for unreadable frames)."
    )
    code: ErrorCode = Field(description="Error category (protocol.errors.ErrorCode).", strict=False)
    message: str = Field(
        max_length=MAX_ERROR_MESSAGE_CHARS,
        description="What went wrong, naming the bad value and what is allowed.",
    )
    retryable: bool = Field(description="True when sending the same request later may succeed.")

    @classmethod
    def for_code(
        cls, code: ErrorCode, message: str, request_id: str | None = None
    ) -> ErrorReply:
        """Build a reply whose ``retryable`` follows the code; long messages are cut."""
        code = ErrorCode(code)
        if len(message) > MAX_ERROR_MESSAGE_CHARS:
            message = message[: MAX_ERROR_MESSAGE_CHARS - 3] + "..."
        return cls(request_id=request_id, code=code, message=message, retryable=code.retryable)

    @classmethod
    def from_exception(cls, exc: BaseException, request_id: str | None = None) -> ErrorReply:
        """Map any exception onto a reply via protocol.errors.code_for_exception_name."""
        code = code_for_exception_name(exc)
        message = str(exc) or type(exc).__name__
        if code is ErrorCode.INTERNAL:
            message = f"{type(exc).__name__}: {message}"
        return cls.for_code(code, message, request_id)


# --------------------------------------------------------------------------- decode -> router

MAX_STEP_MESSAGES = 1024  # messages one StepFrame may carry (more running requests: more frames)

StreamMessage = Annotated[TokenChunk | GenerateResult | ErrorReply, Field(discriminator="type")]


class StepFrame(WireMessage):
    """What a stream's producer made for one subscriber's requests since its previous frame:
    decode -> router, normally one engine step (each running request's TokenChunk, and the
    GenerateResult or ErrorReply of those that ended); router -> HTTP front end, the same after
    the text stage. One frame per step for all requests, not one per request per step; a
    request's messages keep their order."""

    type: Literal["step_frame"] = Field("step_frame", description="Message type discriminator.")
    seq: int = Field(
        ge=0,
        le=MAX_SEQ,
        description="Frame number on this subscription, from 0 with no gaps (the receiver "
        "checks it).",
    )
    messages: list[StreamMessage] = Field(
        max_length=MAX_STEP_MESSAGES,
        description=f"TokenChunk, GenerateResult and ErrorReply messages, each naming its "
        f"request (at most {MAX_STEP_MESSAGES}).",
    )
    ended: list[RequestId] = Field(
        default_factory=list,
        max_length=MAX_STEP_MESSAGES,
        description="Requests whose streams are over: no message for them follows (their "
        "last one is in this frame or an earlier one).",
    )

    @field_validator("messages")
    @classmethod
    def _every_message_names_its_request(cls, v: list) -> list:
        for i, m in enumerate(v):
            if m.request_id is None:
                raise ValueError(f"messages[{i}] ({m.type}) has no request_id")
        return v


# --------------------------------------------------------------------------- internal control


class ExpertFetch(WireMessage):
    """decode -> expert_loader: make (layer, expert) available; answered by ExpertReady."""

    type: Literal["expert_fetch"] = Field("expert_fetch", description="Message type discriminator.")
    layer: int = Field(ge=0, le=MAX_LAYER, description="Layer index.")
    expert: int = Field(ge=0, le=MAX_EXPERT, description="Expert index within the layer.")
    slot: int | None = Field(
        None, ge=0, le=MAX_SLOT, description="Destination device-cache slot, if already chosen."
    )
    seq: int = Field(
        ge=0, le=MAX_SEQ, description="Sender's request sequence number, echoed in ExpertReady."
    )


class ExpertReady(WireMessage):
    """expert_loader -> decode: the expert's bytes are staged; copy them from the location given.

    The location is either a shared-memory segment plus offset, or an opaque handle string.
    """

    type: Literal["expert_ready"] = Field("expert_ready", description="Message type discriminator.")
    layer: int = Field(ge=0, le=MAX_LAYER, description="Layer index.")
    expert: int = Field(ge=0, le=MAX_EXPERT, description="Expert index within the layer.")
    seq: int = Field(ge=0, le=MAX_SEQ, description="The seq of the ExpertFetch this answers.")
    nbytes: int = Field(ge=0, le=MAX_EXPERT_NBYTES, description="Size of the expert blob in bytes.")
    sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="Lower-case hex sha256 of the blob, as in the store manifest.",
    )
    shm_name: str | None = Field(
        None,
        pattern=r"^/?[A-Za-z0-9_][A-Za-z0-9_.-]{0,249}$",
        description="Name of the shared-memory segment holding the blob (with shm_offset).",
    )
    shm_offset: int | None = Field(
        None, ge=0, le=2**62, description="Byte offset of the blob inside shm_name."
    )
    handle: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Opaque location of the blob, used instead of shm_name/shm_offset.",
    )
    tier: Literal["ram", "nvme"] = Field(
        description="Where the loader found the blob: its host-RAM tier or the NVMe store."
    )

    @model_validator(mode="after")
    def _one_location(self) -> ExpertReady:
        shm = (self.shm_name is not None, self.shm_offset is not None)
        if shm[0] != shm[1]:
            raise ValueError("shm_name and shm_offset must be given together")
        if shm[0] == (self.handle is not None):
            raise ValueError("give either shm_name with shm_offset, or handle; not both, not none")
        return self


class ExpertEvict(WireMessage):
    """decode -> expert_loader: (layer, expert) left the device cache; the loader may drop it."""

    type: Literal["expert_evict"] = Field("expert_evict", description="Message type discriminator.")
    layer: int = Field(ge=0, le=MAX_LAYER, description="Layer index.")
    expert: int = Field(ge=0, le=MAX_EXPERT, description="Expert index within the layer.")


class HealthRequest(WireMessage):
    """Ask a service whether it is healthy."""

    type: Literal["health_request"] = Field(
        "health_request", description="Message type discriminator."
    )


HealthValue = int | FiniteFloat | Annotated[str, Field(max_length=1024)]


class HealthReply(WireMessage):
    """A service's health and a few figures about it."""

    type: Literal["health_reply"] = Field("health_reply", description="Message type discriminator.")
    service: str = Field(
        min_length=1,
        max_length=64,
        pattern=REQUEST_ID_PATTERN,
        description="Which service answers, e.g. 'decode' or 'expert_loader.3'.",
    )
    ok: bool = Field(description="True when the service can take work.")
    detail: dict[Annotated[str, Field(min_length=1, max_length=64)], HealthValue] = Field(
        default_factory=dict,
        max_length=MAX_HEALTH_DETAIL_ITEMS,
        description=f"Up to {MAX_HEALTH_DETAIL_ITEMS} named figures (queue depth, hit rate, "
        "last error), each a number or a short string.",
    )


# --------------------------------------------------------------------------- registry

_ALL_MESSAGES: tuple[type[WireMessage], ...] = (
    GenerateRequest,
    TokenChunk,
    GenerateResult,
    ErrorReply,
    StepFrame,
    ExpertFetch,
    ExpertReady,
    ExpertEvict,
    HealthRequest,
    HealthReply,
)


def _type_name(cls: type[WireMessage]) -> str:
    default: Any = cls.model_fields["type"].default
    assert isinstance(default, str), cls
    return default


MESSAGE_TYPES: dict[str, type[WireMessage]] = {_type_name(c): c for c in _ALL_MESSAGES}
assert len(MESSAGE_TYPES) == len(_ALL_MESSAGES), "duplicate message type names"
