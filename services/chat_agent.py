"""The router's side of tools, reasoning and structured output for one chat request.

    plan = ChatPlan.build(tokenizer, syntax, harmony, req)   # in the router's tokenizer thread
    plan.prompt_ids          # rendered through the model's template (engine.agent.render)
    plan.grammar             # protocol.GrammarSpec for the sampler, or None
    plan.stage(stop, stop_ids)  # the text stage that splits reasoning and parses tool calls

A chat whose model shows a reasoning syntax or whose request has tools gets a parsing stage;
others keep the plain one. tool_choice required / function and response_format json_* become a
grammar (engine.agent.grammar); when the prompt opened ``<think>`` the grammar lets the model
finish its reasoning first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

from engine.agent.grammar import (Constraint, after_open_reasoning, forced_calls_grammar,
                                  response_format_grammar)
from engine.agent.render import render_chat
from engine.agent.syntax import AgentSyntax, make_parser, opens_reasoning
from engine.errors import RequestValidationError
from engine.harmony import HarmonyTokens
from protocol import GenerateRequest, GrammarSpec
from services.text_stage import HarmonyTextStage, ParsedTextStage, TextStage


def tool_schemas(req: GenerateRequest) -> dict[str, dict] | None:
    """name -> parameters schema of the request's tools (None without tools)."""
    if not req.tools:
        return None
    out = {}
    for t in req.tools:
        try:
            schema = json.loads(t.parameters)
        except ValueError as e:
            raise RequestValidationError(f"tools[{t.name}].parameters: not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise RequestValidationError(f"tools[{t.name}].parameters: a JSON schema must be an object")
        out[t.name] = schema
    return out


@dataclass
class ChatPlan:
    prompt_ids: list[int]
    prompt_text: str
    grammar: GrammarSpec | None
    syntax: AgentSyntax
    tools: dict[str, dict] | None
    parse_calls: bool
    tokenizer: object
    harmony: HarmonyTokens | None

    @classmethod
    def build(cls, tokenizer, syntax: AgentSyntax, harmony: HarmonyTokens | None,
              req: GenerateRequest) -> "ChatPlan":
        tools = tool_schemas(req)
        choice = req.tool_choice
        grammar: Constraint | None = None
        if tools and choice in ("required", "function"):
            grammar = forced_calls_grammar(syntax.tools, [t.model_dump() for t in req.tools],
                                           req.tool_name if choice == "function" else None,
                                           req.parallel_tool_calls)
        elif req.response_format is not None:
            grammar = response_format_grammar(req.response_format.type, req.response_format.schema_text)
        ids, text = render_chat(tokenizer, [m.model_dump() for m in req.messages],
                                tools=[t.model_dump() for t in req.tools or ()], tool_choice=choice,
                                enable_thinking=req.enable_thinking,
                                reasoning_effort=req.reasoning_effort, syntax=syntax)
        if grammar is not None and syntax.reasoning == "think" and opens_reasoning(text):
            grammar = after_open_reasoning(grammar)
        spec = None if grammar is None else GrammarSpec(kind=grammar.kind, text=grammar.text)
        return cls(ids, text, spec, syntax, tools, bool(tools) and choice != "none", tokenizer, harmony)

    def stage(self, stop: Iterable[str], stop_ids: Iterable[int]) -> TextStage:
        if self.harmony is not None:
            return HarmonyTextStage(self.tokenizer, self.harmony, stop, stop_ids, self.tools,
                                    self.parse_calls)
        if self.syntax.reasoning is None and not self.parse_calls:
            return TextStage(self.tokenizer, self.prompt_ids, stop, stop_ids)
        parser = make_parser(self.syntax, self.tools, self.prompt_text, parse_tools=self.parse_calls)
        return ParsedTextStage(self.tokenizer, self.prompt_ids, parser, stop, stop_ids)
