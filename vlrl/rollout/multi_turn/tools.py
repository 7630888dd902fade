"""Tool functions: their schema (from signature and docstring), argument checks, and what they return.

A tool is a plain function in a file of the user's, `path/to/tools.py:function`:

    def crop(x0: int, y0: int, x1: int, y1: int, *, image_path: str):
        '''Crop the image to a box and return it.

        Args:
            x0: left edge in pixels
            ...
        '''

- Positional-or-keyword parameters are the model's arguments; they make the schema the model sees
  (types from annotations, descriptions from the docstring's `Args:` block).
- Keyword-only parameters (after `*`) are per-row context from the dataset column
  `multi_turn.tools_kwargs_key` ({tool name: {keyword: value}}); the model never sees them.
- It returns text (`str`), an image (`PIL.Image`), or both (a tuple/list of them).

This module runs inside the tool worker processes; it imports neither torch nor transformers.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass
class ToolOutput:
    """What one tool call gave back, as shown to the model."""

    text: str = ""
    images: list[Any] = field(default_factory=list)  # PIL images
    error: bool = False  # the model is told about a failure (bad call, exception, timeout)
    timed_out: bool = False


def _json_type(annotation: Any) -> str | None:
    origin = typing.get_origin(annotation) or annotation
    return _JSON_TYPES.get(origin) if isinstance(origin, type) else None


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) of a Google-style docstring."""
    lines = inspect.cleandoc(doc or "").splitlines()
    description, params, in_args = [], {}, False
    for line in lines:
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args:
            match = re.match(r"(\w+)\s*(\([^)]*\))?\s*:\s*(.*)", stripped)
            if match and not stripped.endswith(":"):
                params[match.group(1)] = match.group(3)
            else:  # a blank line or the next section (Returns:) ends the block
                in_args = False
            continue
        description.append(line)
    text = "\n".join(description).strip().split("\n\n")[0]
    return " ".join(text.split()), params


def model_parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """The parameters the model fills (positional-or-keyword ones)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    return [p for p in inspect.signature(fn).parameters.values() if p.kind in kinds]


def context_parameters(fn: Callable[..., Any]) -> list[str]:
    """The keyword-only parameters (per-row context, hidden from the model)."""
    return [
        p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]


def tool_schema(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    """The OpenAI-style function schema the chat template's tools section shows the model."""
    description, param_docs = _docstring_parts(fn.__doc__ or "")
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: fall back to the raw ones
        hints = {}
    properties: dict[str, Any] = {}
    required = []
    for param in model_parameters(fn):
        prop: dict[str, Any] = {}
        kind = _json_type(hints.get(param.name, param.annotation))
        if kind:
            prop["type"] = kind
        if param.name in param_docs:
            prop["description"] = param_docs[param.name]
        properties[param.name] = prop
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description or name,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def check_arguments(fn: Callable[..., Any], name: str, arguments: Mapping[str, Any]) -> str | None:
    """An error message for the model when `arguments` do not fit the tool, else None."""
    params = {p.name: p for p in model_parameters(fn)}
    unknown = sorted(set(arguments) - set(params))
    if unknown:
        return f"error: {name} has no argument(s) {unknown}; its arguments are {sorted(params)}"
    missing = sorted(
        n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in arguments
    )
    if missing:
        return f"error: {name} needs the argument(s) {missing}"
    return None


def normalize_output(value: Any, max_images: int) -> ToolOutput:
    """A tool's return value as `ToolOutput`: text, a PIL image, or a tuple/list of them."""
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    texts, images = [], []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
        elif hasattr(item, "convert") and hasattr(item, "size"):  # a PIL image (PIL is not imported here)
            images.append(item.convert("RGB"))
        elif item is None:
            continue
        else:
            return ToolOutput(
                f"error: the tool returned a {type(item).__name__}; tools return text or images", error=True
            )
    if len(images) > max_images:
        return ToolOutput(
            f"error: the tool returned {len(images)} images; at most {max_images} "
            "(worker.rollout.multi_turn.max_tool_images)",
            error=True,
        )
    return ToolOutput("\n".join(texts), images)
