"""What agents need from a chat model, on both sides of the engine, for every API that serves it.

Request side (engine.agent.render): ``render_chat`` turns chat messages (tool results, earlier
tool calls), tools, ``tool_choice``, ``enable_thinking`` and ``reasoning_effort`` into prompt ids
through the model's own chat template.

Output side (engine.agent.parsers): one streaming parser chain per request,
``OutputParser.feed(text) -> list[Delta]`` / ``finish() -> list[Delta]``; a Delta is answer text,
reasoning text, the start of a tool call (index, id, name) or a piece of its arguments.
Reasoning parsers (``<think>...</think>``, gpt-oss harmony channels) and tool-call parsers
(Hermes/Qwen ``<tool_call>`` JSON, Qwen3-Coder XML, DeepSeek-V3, harmony) share that seam.
engine.agent.syntax picks the syntax from the chat template (a flag overrides it).

Constraints (engine.agent.grammar): ``response_format`` and forced tool calls become a
GrammarSpec, compiled by xgrammar into a token mask applied in the sampler to the rows that need
it, batched; rows without one are untouched.
"""

from engine.agent.deltas import Delta, OutputParser, ToolCallOut, collect
from engine.agent.render import render_chat
from engine.agent.syntax import AgentSyntax, detect_syntax

__all__ = ["AgentSyntax", "Delta", "OutputParser", "ToolCallOut", "collect", "detect_syntax",
           "render_chat"]
