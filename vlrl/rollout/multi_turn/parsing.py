"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in an assistant turn.

A turn that stops on the end-of-call marker holds one call (generation stops there). Anything that
is not a well-formed call becomes a `ToolCallError` whose message is shown to the model as the tool
response, so a malformed call never stops the rollout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its keyword arguments (JSON values)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCallError:
    """A call that could not be parsed; `message` is what the model is told."""

    message: str
    raw: str


def parse_tool_call(text: str) -> ToolCall | ToolCallError:
    """The last `<tool_call>...</tool_call>` of an assistant turn's text, parsed.

    `arguments` may be an object or a JSON string holding one (some models quote it).
    """
    end = text.rfind(CALL_END)
    start = text.rfind(CALL_START, 0, end if end >= 0 else len(text))
    if start < 0 or end < 0:
        return ToolCallError(f"error: a tool call must be written as {CALL_START}{{json}}{CALL_END}", text)
    raw = text[start + len(CALL_START) : end].strip()
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as err:
        return ToolCallError(f"error: the tool call is not valid JSON ({err.msg} at char {err.pos})", raw)
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return ToolCallError('error: a tool call must be a JSON object with a string "name"', raw)
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCallError('error: "arguments" must be a JSON object', raw)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError('error: "arguments" must be a JSON object', raw)
    return ToolCall(payload["name"], arguments)
