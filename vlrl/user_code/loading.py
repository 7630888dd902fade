"""A user's `path/to/file.py:function`, imported as a fresh module.

The file is imported under a unique name (it is never put on `sys.path`), so two files with the
same name (or one called `math.py`) do not clash with each other or with installed modules.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import itertools
import os
import sys
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

DEFAULT_FUNCTION = "main"
_counter = itertools.count()


class UserCodeError(RuntimeError):
    """A user file could not be loaded: missing, failed to import, or without the function named."""


def parse_spec(spec: str) -> tuple[str, str]:
    """Split `path/to/file.py:fn` into (path, fn); no `:fn` (or a non-identifier after it) means `main`."""
    path, sep, name = spec.rpartition(":")
    if sep and name.isidentifier():
        return path, name
    return spec, DEFAULT_FUNCTION


def _import_file(path: str, kind: str = "reward") -> ModuleType:
    """Execute the file as a new module; import errors become a `UserCodeError` naming the file."""
    stem = "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(path))[0])
    module_name = f"vlrl_{kind}_{stem}_{os.getpid()}_{next(_counter)}"
    loader = importlib.machinery.SourceFileLoader(module_name, path)
    module_spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
    assert module_spec is not None
    module = importlib.util.module_from_spec(module_spec)
    # Registered before exec so dataclasses/pickle inside the file can find their module.
    sys.modules[module_name] = module
    try:
        loader.exec_module(module)
    except BaseException as exc:  # SystemExit at import time is a load error too
        del sys.modules[module_name]
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise UserCodeError(f"{kind} file {path} failed to import:\n{_describe_import_error(exc)}") from exc
    return module


def _describe_import_error(exc: BaseException) -> str:
    """The traceback frames of the user's code (importlib and this module dropped) and the error."""
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith("<frozen") and frame.filename != __file__
    ]
    return "".join(traceback.format_list(frames) + traceback.format_exception_only(type(exc), exc)).rstrip()


def _callables_in(module: ModuleType) -> list[str]:
    return sorted(
        name for name, value in vars(module).items() if callable(value) and not name.startswith("_")
    )


def resolve_spec(spec: str, kind: str = "reward") -> tuple[str, str]:
    """(absolute file path, function name) for a spec, checking only that the file exists."""
    if not spec or not isinstance(spec, str):
        raise UserCodeError(f"no {kind} function given: path/to/file.py:function")
    path, name = parse_spec(spec)
    abspath = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(abspath):
        raise UserCodeError(f"{kind} file not found: {path!r} (resolved to {abspath}; spec {spec!r})")
    return abspath, name


def load_function(spec: str, kind: str = "reward") -> tuple[Callable[..., Any], str, str, ModuleType]:
    """(function, absolute path, function name, module) of `path/to/file.py:fn` (default `main`).

    `kind` names the file in messages ("reward", "tool", ...). Raises `UserCodeError` naming the
    file and function when the file is missing, fails to import, lacks the function, or the
    attribute is not callable.
    """
    abspath, name = resolve_spec(spec, kind)
    module = _import_file(abspath, kind)
    if not hasattr(module, name):
        found = ", ".join(_callables_in(module)) or "none"
        raise UserCodeError(f"function {name!r} not found in {abspath}; callables defined there: {found}")
    fn = getattr(module, name)
    if not callable(fn):
        raise UserCodeError(f"{abspath}:{name} is a {type(fn).__name__}, not a function")
    return fn, abspath, name, module
