"""Tools declared in a YAML file (`worker.rollout.multi_turn.tool_config_path`) with their schemas.

    tools:
      - callable: calculator.py:calculate      # relative to this YAML file's folder
        tool_schema:                           # OpenAI function format, shown to the model as is
          type: function
          function:
            name: calculate                    # the name the model calls (may differ from the function's)
            description: Evaluate an arithmetic expression.
            parameters:
              type: object
              properties:
                expression: {type: string, description: "for example (3 + 4) * 2"}
              required: [expression]

`read_tool_config` checks the file's shape without importing any tool (the driver runs it at
start-up). `check_schema_matches` compares a schema with the loaded function's signature; it runs in
the tool worker processes, where tool files are imported. Every error names the file and the tool.
No torch here: tool workers import this module.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

JSON_SCHEMA_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")
KEY = "worker.rollout.multi_turn.tool_config_path"


class ToolConfigError(ValueError):
    """A tool YAML file (or a tool it names) is not usable; the message names the file and the tool."""


@dataclass(frozen=True)
class ToolEntry:
    """One tool: `callable` (`path/to/file.py:function`, absolute for YAML entries) and the schema the
    model sees (None: built from the function's signature and docstring)."""

    callable: str
    schema: dict[str, Any] | None = None
    source: str = "worker.rollout.multi_turn.tools"
    """Where it was declared, for error messages."""

    @property
    def name(self) -> str | None:
        """The name the model calls it by, when the schema gives it."""
        return self.schema["function"]["name"] if self.schema else None


def tool_entries(mt_config: Any) -> list[ToolEntry]:
    """Every tool of a `MultiTurnConfig`: the `tools` list (schemas from signatures), then the YAML's."""
    entries = [ToolEntry(spec) for spec in mt_config.tools]
    if mt_config.tool_config_path:
        entries += read_tool_config(mt_config.tool_config_path)
    return entries


def read_tool_config(path: str) -> list[ToolEntry]:
    """The tools of a YAML file, its shape checked (raises `ToolConfigError`)."""
    if not os.path.isfile(path):
        raise ToolConfigError(f"{KEY}: file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as file:
            tree = yaml.safe_load(file)
    except yaml.YAMLError as exc:
        raise ToolConfigError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(tree, dict) or set(tree) != {"tools"} or not isinstance(tree["tools"], list):
        raise ToolConfigError(f"{path}: the file must hold one key, `tools:`, with a list of tools")
    if not tree["tools"]:
        raise ToolConfigError(f"{path}: `tools:` is empty")
    folder = os.path.dirname(os.path.abspath(path))
    entries = [_entry(item, i, path, folder) for i, item in enumerate(tree["tools"])]
    names = [e.name for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1 and n is not None})
    if twice:
        raise ToolConfigError(f"{path}: tool name(s) {twice} declared more than once")
    return entries


def _entry(item: Any, index: int, path: str, folder: str) -> ToolEntry:
    where = f"{path}: tools[{index}]"
    if not isinstance(item, dict):
        raise ToolConfigError(f"{where} must be a mapping with `callable` and `tool_schema`")
    unknown = sorted(set(item) - {"callable", "tool_schema"})
    if unknown or "callable" not in item or "tool_schema" not in item:
        raise ToolConfigError(
            f"{where} must have exactly the keys `callable` and `tool_schema` (has {sorted(item)})"
        )
    name = _check_schema_shape(item["tool_schema"], where, path)
    where = f"{path}: tool {name!r}"
    spec = item["callable"]
    if not isinstance(spec, str) or ":" not in spec or not spec.rsplit(":", 1)[1].isidentifier():
        raise ToolConfigError(f"{where}: `callable` must be `path/to/file.py:function`, got {spec!r}")
    file, function = spec.rsplit(":", 1)
    file = os.path.join(folder, os.path.expanduser(file))  # an absolute path stays as it is
    if not os.path.isfile(file):
        raise ToolConfigError(
            f"{where}: callable file {file!r} does not exist (paths are relative to the YAML)"
        )
    return ToolEntry(f"{os.path.normpath(file)}:{function}", item["tool_schema"], path)


def _check_schema_shape(schema: Any, where: str, path: str) -> str:
    """The schema's tool name, after checking it is `{type: function, function: {name, description,
    parameters: {type: object, properties, required}}}`."""
    if (
        not isinstance(schema, dict)
        or schema.get("type") != "function"
        or set(schema) != {"type", "function"}
    ):
        raise ToolConfigError(f"{where}: tool_schema must be {{type: function, function: {{...}}}}")
    function = schema["function"]
    if not isinstance(function, dict):
        raise ToolConfigError(f"{where}: tool_schema.function must be a mapping")
    name = function.get("name")
    if not isinstance(name, str) or not name.isidentifier():
        raise ToolConfigError(f"{where}: tool_schema.function.name must be an identifier, got {name!r}")
    where = f"{path}: tool {name!r}"
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise ToolConfigError(f"{where}: tool_schema.function has unknown key(s) {unknown}")
    if not isinstance(function.get("description"), str) or not function["description"].strip():
        raise ToolConfigError(f"{where}: tool_schema.function.description must be a non-empty string")
    params = function.get("parameters")
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ToolConfigError(f"{where}: tool_schema.function.parameters must be {{type: object, ...}}")
    properties, required = params.get("properties", {}), params.get("required", [])
    if not isinstance(properties, dict):
        raise ToolConfigError(f"{where}: parameters.properties must be a mapping of argument names")
    for arg, prop in properties.items():
        kind = prop.get("type") if isinstance(prop, dict) else None
        kinds = kind if isinstance(kind, list) else [kind]
        if not isinstance(prop, dict) or not all(k in JSON_SCHEMA_TYPES for k in kinds):
            raise ToolConfigError(
                f"{where}: argument {arg!r} needs a `type:` out of {list(JSON_SCHEMA_TYPES)}, got {prop!r}"
            )
    if not isinstance(required, list) or not all(r in properties for r in required):
        raise ToolConfigError(
            f"{where}: parameters.required must list arguments of parameters.properties, got {required!r}"
        )
    return name


def check_schema_matches(fn: Callable[..., Any], entry: ToolEntry) -> None:
    """Raise `ToolConfigError` when the schema's arguments do not fit the function's signature:
    every schema argument must be a model parameter (before `*`) of the function, and every function
    parameter without a default must be a required schema argument. Parameters with defaults may be
    left out of the schema (the model then cannot set them)."""
    assert entry.schema is not None
    where = f"{entry.source}: tool {entry.name!r} ({entry.callable})"
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    positional = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    model_params = {n: p for n, p in params.items() if p.kind in positional}
    declared = entry.schema["function"]["parameters"]
    properties, required = declared.get("properties", {}), set(declared.get("required", []))
    hidden = sorted(n for n in properties if params.get(n) is not None and n not in model_params)
    if hidden:
        raise ToolConfigError(
            f"{where}: schema argument(s) {hidden} are keyword-only in the function (per-row context "
            "from tools_kwargs, hidden from the model); drop them from the schema or the `*`"
        )
    unknown = sorted(n for n in properties if n not in params)
    if unknown and not takes_any:
        raise ToolConfigError(
            f"{where}: schema argument(s) {unknown} are not parameters of the function; "
            f"its parameters are {sorted(model_params)}"
        )
    needed = {n for n, p in model_params.items() if p.default is inspect.Parameter.empty}
    missing = sorted(needed - required)
    if missing:
        raise ToolConfigError(
            f"{where}: the function needs {missing} (no default) but the schema does not list them "
            "as required arguments"
        )
