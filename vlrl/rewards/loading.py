"""Load a drop-in reward function from `path/to/file.py:function` (`vlrl.user_code.loading`).

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

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vlrl.rewards.types import RewardLoadError
from vlrl.user_code.loading import UserCodeError, load_function, resolve_spec

REWARD_TYPES = ("batch", "sequential")


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


def reward_file(spec: str) -> tuple[str, str]:
    """(absolute file path, function name) of a reward spec, checking only that the file exists."""
    if not spec or not isinstance(spec, str):
        raise RewardLoadError(
            "no reward function given: set worker.reward.reward_function=path/to/file.py:function"
        )
    try:
        return resolve_spec(spec, "reward")
    except UserCodeError as exc:
        raise RewardLoadError(str(exc)) from exc


def load_reward_function(spec: str, reward_type: str | None = None) -> LoadedReward:
    """Load `path/to/file.py:fn` (default function `main`) and decide its reward type.

    Raises `RewardLoadError` naming the file and function when the file is missing, fails to import,
    lacks the function, or the attribute is not callable.
    """
    reward_file(spec)
    try:
        fn, abspath, name, module = load_function(spec, "reward")
    except UserCodeError as exc:
        raise RewardLoadError(str(exc)) from exc
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
