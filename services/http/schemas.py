"""Request bodies of the OpenAI-compatible endpoints, and the error every refusal becomes.

Bodies are validated strictly (no "5" for 5, no true for 1, unknown fields refused), so a typo
is a 400 naming the field rather than a silently ignored option. Fields OpenAI defines but this
server cannot honour yet (``n > 1``, images, ``logit_bias``, ``echo``, ...) are refused
with a 400 naming them; fields that change nothing here (``user``, ``metadata``, ``store``, ...)
are accepted. Our extras ride as extra body fields: ``top_k``, ``min_p``,
``repetition_penalty``, ``speculative``, ``num_speculative_tokens``, ``enable_thinking`` (also
read from vLLM's ``chat_template_kwargs``). Tools, ``tool_choice``, tool messages and
``response_format`` (json_object, json_schema) are translated here (services/http/tools_in.py).

    req = parse_body(ChatCompletionRequest, raw_bytes)   # OpenAIError(400) naming the field
    greq = req.to_generate(request_id)                     # protocol.GenerateRequest
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol import ChatMessage, GenerateRequest, SamplingParams
from services.http.errors import OpenAIError, invalid
from services.http.tools_in import chat_message, response_format, tool_choice, tool_specs
from protocol.messages import MAX_CHAT_MESSAGES, MAX_DRAFT_TOKENS, MAX_LOGPROBS, MAX_PROMPT_CHARS

# chat without max_tokens: OpenAI generates until the context ends; here the wire default (256),
# lowered by the router to what the context leaves after the prompt
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# Deepest array/object nesting a request body may have. Python's json (and pydantic's parser)
# recurse per level: 100,000 nested arrays raised RecursionError (a 500). Real bodies (tool JSON
# schemas included) stay far below this.
MAX_JSON_DEPTH = 128
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = np.zeros(256, dtype=np.int32)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
    """Deepest bracket nesting of a JSON text, brackets inside strings not counted; a scan
    without recursion (regex and numpy: linear, C speed on a 16 MiB body). Malformed text gets
    some number; the decoder then reports it."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return int(np.cumsum(_DEPTH_STEP[np.frombuffer(brackets, dtype=np.uint8)]).max())


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """Every endpoint's body: a JSON object, nested at most MAX_JSON_DEPTH deep, valid for
    ``model``; else an OpenAIError(400) naming the problem."""
    if not raw:
        raise OpenAIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise OpenAIError(400, f"the request body nests arrays/objects {depth} deep; at most "
                               f"{MAX_JSON_DEPTH} levels are accepted", code="invalid_json")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise invalid(e) from None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage on every chunk


def _unsupported(param: str, what: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {what} is not supported by this server", param=param,
                       code="unsupported_parameter")


# Content parts carrying pixels (OpenAI chat's image_url, the Responses API's input_image, and
# their video forms): every model here is served text-only (a vision-language checkpoint such as
# Qwen3.5-MoE runs without its vision tower, which is never loaded).
VISUAL_PART_TYPES = frozenset({"image_url", "input_image", "image", "video_url", "input_video", "video"})


def _visual_refused(param: str, part_type: str, model: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: model {model!r} does not accept images or video (a content part "
                            f"of type {part_type!r}); it is served text-only, without a vision tower: "
                            f"send text content parts only", param=param, code="unsupported_modality")


class _Sampling(_Body):
    """The fields both endpoints share."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=256)
    # extras (extra_body in the openai client)
    top_k: int | None = Field(None, ge=-1, le=1_000_000)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    speculative: bool | None = None
    num_speculative_tokens: int | None = Field(None, ge=1, le=MAX_DRAFT_TOKENS)

    def _check_common(self) -> None:
        if self.n not in (None, 1):
            raise _unsupported("n", f"n={self.n} (several choices per request)")
        if self.logit_bias:
            raise _unsupported("logit_bias", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options: only allowed when stream is true",
                              param="stream_options", code="invalid_value")

    def _stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for i, s in enumerate(stop):
            if not 1 <= len(s) <= 256:
                param = "stop" if isinstance(self.stop, str) else f"stop[{i}]"
                raise OpenAIError(400, f"{param}: a stop string must have 1..256 characters",
                                  param=param, code="invalid_value")
        if len(stop) > 16:
            raise OpenAIError(400, f"stop: at most 16 stop strings, got {len(stop)}", param="stop",
                              code="invalid_value")
        return stop

    def _sampling(self, max_tokens: int | None, default_max: int | None, logprobs: int | None) -> SamplingParams:
        """``default_max`` None: the wire default (256), which the router lowers to what the
        context leaves after the prompt."""
        kw: dict[str, Any] = {"stop": self._stop_list(), "logprobs": logprobs}
        if max_tokens or default_max:
            kw["max_tokens"] = max_tokens or default_max
        for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                     "min_p", "repetition_penalty", "speculative", "num_speculative_tokens"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = float(v) if isinstance(v, int) and name not in (
                    "seed", "speculative", "num_speculative_tokens") else v
        if self.top_k is not None:
            kw["top_k"] = max(self.top_k, 0)  # -1 (vLLM's "off") == 0 here
        try:
            return SamplingParams(**kw)
        except ValidationError as e:
            raise invalid(e) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are supported."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


class ChatMessageIn(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None
    # a reasoning model's earlier answer sent back as it came (vLLM's field); not rendered: chat
    # templates of reasoning models drop earlier turns' reasoning
    reasoning_content: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # to the chat template
    modalities: list[str] | None = None
    enable_thinking: bool | None = None  # to the chat template (Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's; enable_thinking is read from it

    def _messages(self) -> list[ChatMessage]:
        out = []
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if m.role == "function":
                raise _unsupported(f"{where}.role", "role 'function' (deprecated; send role 'tool')")
            if m.function_call is not None:
                raise _unsupported(f"{where}.function_call", "function_call")
            if isinstance(m.content, list):
                texts = []
                for j, part in enumerate(m.content):
                    if part.type in VISUAL_PART_TYPES:
                        raise _visual_refused(f"{where}.content[{j}]", part.type, self.model)
                    if part.type != "text":
                        raise _unsupported(f"{where}.content[{j}]", f"content parts of type {part.type!r}")
                    text = (part.model_extra or {}).get("text")
                    if not isinstance(text, str):
                        raise OpenAIError(400, f"{where}.content[{j}].text: a text part needs a "
                                          f"string 'text'", param=f"{where}.content[{j}].text",
                                          code="invalid_value")
                    texts.append(text)
                content = "".join(texts)
            else:
                content = m.content or ""
            if len(content) > MAX_PROMPT_CHARS:
                raise OpenAIError(400, f"{where}.content: longer than {MAX_PROMPT_CHARS} characters",
                                  param=f"{where}.content", code="invalid_value")
            role = "system" if m.role == "developer" else m.role
            out.append(chat_message(where, role, content, m))
        return out

    def to_generate(self, request_id: str) -> GenerateRequest:
        self._check_common()
        if self.functions:
            raise _unsupported("functions", "functions (deprecated; send tools)")
        if self.function_call not in (None, "none"):
            raise _unsupported("function_call", "function_call (deprecated; send tool_choice)")
        if self.modalities not in (None, ["text"]):
            raise _unsupported("modalities", f"modalities {self.modalities}")
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs",
                              code="invalid_value")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        sampling = self._sampling(self.max_completion_tokens or self.max_tokens,
                                  None, logprobs)
        tools = tool_specs(self.tools)
        choice, name = tool_choice(self.tool_choice, tools)
        thinking = self.enable_thinking
        kwargs = self.chat_template_kwargs or {}
        if thinking is None and "enable_thinking" in kwargs:
            thinking = kwargs["enable_thinking"]
            if not isinstance(thinking, bool):
                raise OpenAIError(400, "chat_template_kwargs.enable_thinking: must be true or false",
                                  param="chat_template_kwargs.enable_thinking", code="invalid_value")
        try:
            return GenerateRequest(request_id=request_id, messages=self._messages(), sampling=sampling,
                                   stream=bool(self.stream), reasoning_effort=self.reasoning_effort,
                                   enable_thinking=thinking, tools=tools, tool_choice=choice,
                                   tool_name=name, parallel_tool_calls=self.parallel_tool_calls is not False,
                                   response_format=response_format(self.response_format))
        except ValidationError as e:
            raise invalid(e) from None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def to_generate(self, request_id: str) -> GenerateRequest:
        self._check_common()
        if self.echo:
            raise _unsupported("echo", "echo")
        if self.best_of not in (None, 1):
            raise _unsupported("best_of", f"best_of={self.best_of}")
        if self.suffix:
            raise _unsupported("suffix", "suffix")
        prompt, ids = self.prompt, None
        if isinstance(prompt, list):
            if len(prompt) == 0:
                raise OpenAIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
            if isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise _unsupported("prompt", f"a batch of {len(prompt)} prompts in one request")
                prompt = prompt[0]
            if isinstance(prompt, list):
                prompt, ids = None, prompt
        if prompt is not None and not 1 <= len(prompt) <= MAX_PROMPT_CHARS:
            raise OpenAIError(400, f"prompt: must have 1..{MAX_PROMPT_CHARS} characters",
                              param="prompt", code="invalid_value")
        sampling = self._sampling(self.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, self.logprobs)
        try:
            return GenerateRequest(request_id=request_id, prompt=prompt, prompt_token_ids=ids,
                                   sampling=sampling, stream=bool(self.stream))
        except ValidationError as e:
            err = invalid(e)
            err.param = "prompt"
            raise err from None
