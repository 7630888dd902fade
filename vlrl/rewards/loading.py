"""Load a drop-in reward function from `path/to/file.py:function`.

The file is imported as a fresh module under a unique name (it is never put on `sys.path`), so two
reward files with the same file name (or one called `math.py`) do not clash with each other or with
installed modules.

Reward type precedence (`batch` or `sequential`):

1. a module attribute `REWARD_TYPE = "batch" | "sequential"` in the file, when present, wins over
   the config's default (`batch`);
2. otherwise the config's `worker.reward.reward_type` (or `batch` when not given);
3. a config that asks for `sequential` for a file that declares `REWARD_TYPE = "batch"` is an error
   (the config default `batch` cannot be told apart from an explicit `batch`, so it never overrides
   a file's declaration).

A batch function gets the whole step's batch in one call, as in EasyR1 (it may compare or normalise
across samples), unless its file declares `PARTIAL_BATCHES = True`: it scores each sample on its own,
so it may be called on part of the batch (several workers, and groups scored as they finish).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import itertools
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vlrl.rewards.types import RewardLoadError

REWARD_TYPES = ("batch", "sequential")
DEFAULT_FUNCTION = "main"
_counter = itertools.count()


@dataclass(frozen=True)
class LoadedReward:
    """A reward function ready to call, with where it came from (for error messages)."""

    fn: Callable[..., Any]
    path: str
    """Absolute path of the file."""
    name: str
    """Function name in the file."""
    reward_type: str
    spec: str
    """The spec it was loaded from, as given."""
    partial_batches: bool = False
    """The file declares `PARTIAL_BATCHES = True` (a batch function may get part of the batch)."""

    @property
    def where(self) -> str:
        """`file.py:function`, the form used in every error message."""
        return f"{self.path}:{self.name}"


def parse_spec(spec: str) -> tuple[str, str]:
    """Split `path/to/file.py:fn` into (path, fn); no `:fn` (or a non-identifier after it) means `main`."""
    path, sep, name = spec.rpartition(":")
    if sep and name.isidentifier():
        return path, name
    return spec, DEFAULT_FUNCTION


def _import_file(path: str, kind: str = "reward") -> ModuleType:
    """Execute the file as a new module; import errors become a `RewardLoadError` naming the file."""
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
        raise RewardLoadError(f"{kind} file {path} failed to import:\n{_describe_import_error(exc)}") from exc
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


def _resolve_type(module: ModuleType, path: str, requested: str | None) -> str:
    declared = getattr(module, "REWARD_TYPE", None)
    for label, value in (("REWARD_TYPE in " + path, declared), ("worker.reward.reward_type", requested)):
        if value is not None and value not in REWARD_TYPES:
            raise RewardLoadError(f"{label}={value!r} must be one of {REWARD_TYPES}")
    if declared is None:
        return requested or "batch"
    if requested == "sequential" and declared == "batch":
        raise RewardLoadError(
            f"worker.reward.reward_type=sequential but {path} declares REWARD_TYPE = 'batch'; "
            "remove one of them"
        )
    return declared


def resolve_spec(spec: str, kind: str = "reward") -> tuple[str, str]:
    """(absolute file path, function name) for a spec, checking only that the file exists."""
    if not spec or not isinstance(spec, str):
        raise RewardLoadError(
            "no reward function given: set worker.reward.reward_function=path/to/file.py:function"
        )
    path, name = parse_spec(spec)
    abspath = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(abspath):
        raise RewardLoadError(f"{kind} file not found: {path!r} (resolved to {abspath}; spec {spec!r})")
    return abspath, name


def load_function(spec: str, kind: str = "reward") -> tuple[Callable[..., Any], str, str, ModuleType]:
    """(function, absolute path, function name, module) of `path/to/file.py:fn` (default `main`).

    `kind` names the file in messages ("reward", "tool", ...). Raises `RewardLoadError` naming the
    file and function when the file is missing, fails to import, lacks the function, or the
    attribute is not callable.
    """
    abspath, name = resolve_spec(spec, kind)
    module = _import_file(abspath, kind)
    if not hasattr(module, name):
        found = ", ".join(_callables_in(module)) or "none"
        raise RewardLoadError(f"function {name!r} not found in {abspath}; callables defined there: {found}")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardLoadError(f"{abspath}:{name} is a {type(fn).__name__}, not a function")
    return fn, abspath, name, module


def load_reward_function(spec: str, reward_type: str | None = None) -> LoadedReward:
    """Load `path/to/file.py:fn` (default function `main`) and decide its reward type.

    Raises `RewardLoadError` naming the file and function when the file is missing, fails to import,
    lacks the function, or the attribute is not callable.
    """
    fn, abspath, name, module = load_function(spec)
    partial = getattr(module, "PARTIAL_BATCHES", False)
    if not isinstance(partial, bool):
        raise RewardLoadError(f"PARTIAL_BATCHES in {abspath} must be True or False, not {partial!r}")
    return LoadedReward(fn, abspath, name, _resolve_type(module, abspath, reward_type), spec, partial)


def check_kwargs(loaded: LoadedReward, kwargs: Mapping[str, Any]) -> None:
    """Fail at start-up when `reward_function_kwargs` names a parameter the function does not take."""
    try:
        params = inspect.signature(loaded.fn).parameters
    except (TypeError, ValueError):  # builtins or C callables: nothing to check against
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    positional_first = list(params)[:1]  # the inputs argument is passed positionally
    accepted = [n for n in params if n not in positional_first]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise RewardLoadError(
            f"worker.reward.reward_function_kwargs has {unknown} but {loaded.where} accepts only "
            f"{accepted or 'no keyword arguments'}"
        )
