"""Entry point of a tool worker process (spawned by `ToolPool`); imports no torch.

The worker loads every tool (and the interaction) from its spec with the reward loader
(`vlrl.user_code.loading.load_function`), checks YAML-declared schemas against the functions' signatures
(`tool_config.check_schema_matches`), reports `ready` with the schemas, then serves calls.

Messages, worker -> parent: ("ready", info) | ("load_error", message) | ("result", job_id, value)
Messages, parent -> worker: ("call", job_id, name, arguments, context)
                            ("interact", job_id, messages, context) | ("stop",)
"""

from __future__ import annotations

import inspect
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from vlrl.rollout.multi_turn.tool_config import ToolConfigError, ToolEntry, check_schema_matches
from vlrl.rollout.multi_turn.tools import (
    ToolOutput,
    check_arguments,
    context_parameters,
    normalize_output,
    tool_schema,
)
from vlrl.user_code.loading import UserCodeError, load_function
from vlrl.user_code.memory import apply_memory_limit

MAX_ERROR_CHARS = 300  # an exception message shown to the model is cut to this


def load_tools(entries: list[ToolEntry]) -> tuple[dict[str, Callable[..., Any]], list[dict[str, Any]]]:
    """({tool name: function}, schemas); names must be unique across all tools.

    A tool's name is its YAML schema's name, else the function's name."""
    tools: dict[str, Callable[..., Any]] = {}
    schemas = []
    for entry in entries:
        fn, _, fn_name, _ = load_function(entry.callable, "tool")
        if entry.schema is not None:
            check_schema_matches(fn, entry)
        name = entry.name or fn_name
        if name in tools:
            raise UserCodeError(
                f"two tools are named {name!r} (worker.rollout.multi_turn.tools / tool_config_path): rename one"
            )
        tools[name] = fn
        schemas.append(entry.schema if entry.schema is not None else tool_schema(fn, name))
    return tools, schemas


def call_tool(
    tools: dict[str, Callable[..., Any]],
    name: str,
    arguments: dict[str, Any],
    context: dict[str, Any],
    max_images: int,
) -> ToolOutput:
    """Run one call; every failure becomes an error output for the model."""
    fn = tools.get(name)
    if fn is None:
        return ToolOutput(f"error: there is no tool named {name!r}; tools: {sorted(tools)}", error=True)
    problem = check_arguments(fn, name, arguments)
    if problem:
        return ToolOutput(problem, error=True)
    hidden = {k: v for k, v in (context or {}).items() if k in context_parameters(fn)}
    try:
        value = fn(**arguments, **hidden)
    except Exception as exc:
        return ToolOutput(
            f"error: {name} raised {type(exc).__name__}: {str(exc)[:MAX_ERROR_CHARS]}", error=True
        )
    except SystemExit as exc:
        return ToolOutput(f"error: {name} called sys.exit({exc.code})", error=True)
    return normalize_output(value, max_images)


def call_interaction(
    fn: Callable[..., Any], messages: list[dict[str, Any]], context: dict[str, Any]
) -> str | None:
    """The interaction's reply as the user, or None to end the episode (also when it fails)."""
    params = inspect.signature(fn).parameters.values()
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    names = {p.name for p in params}
    kwargs = {k: v for k, v in (context or {}).items() if takes_all or k in names}
    try:
        reply = fn(messages, **kwargs)
    except Exception:
        return None
    return reply if isinstance(reply, str) and reply else None


def tool_worker_main(
    conn: Connection,
    specs: list[ToolEntry],
    interaction: str | None,
    max_images: int,
    memory_limit_mb: int | None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    apply_memory_limit(memory_limit_mb)
    try:
        tools, schemas = load_tools(specs)
        interact = load_function(interaction, "interaction")[0] if interaction else None
    except (UserCodeError, ToolConfigError) as exc:
        conn.send(("load_error", str(exc)))
        return
    except BaseException as exc:
        conn.send(("load_error", f"loading tools {specs} raised {type(exc).__name__}: {exc}"))
        return
    conn.send(
        ("ready", {"pid": os.getpid(), "schemas": schemas, "where": ", ".join(e.callable for e in specs)})
    )
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        if message[0] == "stop":
            return
        if message[0] == "call":
            _, job_id, name, arguments, context = message
            conn.send(("result", job_id, call_tool(tools, name, arguments, context, max_images)))
        else:
            _, job_id, messages, context = message
            reply = call_interaction(interact, messages, context) if interact else None
            conn.send(("result", job_id, reply))
