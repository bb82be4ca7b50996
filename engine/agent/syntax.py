"""Which tool-call and reasoning syntax a model writes, read from its chat template.

    detect_syntax(template, arch)  -> AgentSyntax(tools="hermes", reasoning="think")
    make_parser(syntax, tools, prompt_text) -> the request's OutputParser chain (text models)

Tool syntax, first match wins: a gpt-oss model with harmony control tokens -> harmony;
``<function=`` beside ``<tool_call>`` -> qwen3_coder; ``<tool_call>`` -> hermes;
``tool▁calls▁begin`` -> deepseek_v3; none of these (or no template) -> hermes, rendered by us
(engine.agent.render). Reasoning: harmony for gpt-oss; ``<think>`` in the template -> think;
else none. ``serve --tool-call-parser NAME`` overrides the tool syntax.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.agent.deltas import Chain, OutputParser
from engine.agent.reasoning import CLOSE, OPEN, ThinkParser
from engine.agent.tools import deepseek_parser, hermes_parser, qwen_xml_parser
from engine.errors import ConfigError

TOOL_SYNTAXES = ("hermes", "qwen3_coder", "deepseek_v3", "harmony")
REASONING_SYNTAXES = ("think", "harmony", None)
_TEXT_PARSERS = {"hermes": hermes_parser, "qwen3_coder": qwen_xml_parser, "deepseek_v3": deepseek_parser}


@dataclass(frozen=True)
class AgentSyntax:
    tools: str = "hermes"
    reasoning: str | None = None
    template_renders_tools: bool = False  # the template reads `tools` (else render.py adds them)

    def __post_init__(self) -> None:
        if self.tools not in TOOL_SYNTAXES:
            raise ConfigError(f"tool-call parser {self.tools!r} is unknown; allowed: {list(TOOL_SYNTAXES)}")
        if self.reasoning not in REASONING_SYNTAXES:
            raise ConfigError(f"reasoning parser {self.reasoning!r} is unknown; allowed: "
                              f"{list(REASONING_SYNTAXES)}")


def detect_syntax(template: str | None, *, harmony: bool = False,
                  override: str | None = None) -> AgentSyntax:
    """``harmony``: the model writes gpt-oss's harmony format (engine.harmony.harmony_tokens_for)."""
    t = template or ""
    if harmony:
        tools, reasoning = "harmony", "harmony"
    else:
        if "<tool_call>" in t:
            tools = "qwen3_coder" if "<function=" in t else "hermes"
        elif "tool▁calls▁begin" in t:
            tools = "deepseek_v3"
        else:
            tools = "hermes"
        reasoning = "think" if OPEN in t or CLOSE in t else None
    if override is not None:
        tools = override
    return AgentSyntax(tools, reasoning, template_renders_tools="tools" in t)


def opens_reasoning(prompt_text: str) -> bool:
    """The prompt ends inside an open ``<think>`` (the template opened it for the model)."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def make_parser(syntax: AgentSyntax, tools: dict[str, dict] | None, prompt_text: str,
                parse_tools: bool = True) -> OutputParser:
    """The parser chain of one text-model request (harmony models parse tokens:
    engine.agent.harmony_calls). ``tools`` None with ``parse_tools``: any name is a call."""
    if syntax.tools == "harmony":
        raise ConfigError("harmony output is parsed from token ids (engine.agent.harmony_calls)")
    parsers: list[OutputParser] = []
    if syntax.reasoning == "think":
        parsers.append(ThinkParser(opened=opens_reasoning(prompt_text)))
    if parse_tools:
        parsers.append(_TEXT_PARSERS[syntax.tools](tools))
    return Chain(*parsers)
