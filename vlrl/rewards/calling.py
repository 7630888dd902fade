"""Call a loaded reward function on a chunk of inputs and check what it returns.

Runs inside the reward worker processes (and in-process when `num_workers=0`). Everything it returns
is plain Python (floats, strings), so it pickles cheaply and never drags user objects across processes.
"""

from __future__ import annotations

import math
import numbers
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vlrl.rewards.loading import LoadedReward
from vlrl.rewards.types import RewardFailure, RewardInput

Outcome = dict[str, float] | RewardFailure
_MAX_TRACEBACK_CHARS = 4000


def describe_exception(exc: BaseException, skip_frames: int = 0) -> str:
    """`raised Type: message` plus the (trimmed) traceback, for error messages.

    `skip_frames` drops our own calling frames so the traceback starts in the user's file.
    """
    tb_start = exc.__traceback__
    for _ in range(skip_frames):
        tb_start = tb_start.tb_next if tb_start is not None and tb_start.tb_next is not None else tb_start
    tb = "".join(traceback.format_exception(type(exc), exc, tb_start))
    if len(tb) > _MAX_TRACEBACK_CHARS:
        tb = "...\n" + tb[-_MAX_TRACEBACK_CHARS:]
    if isinstance(exc, MemoryError):
        return f"ran out of memory (raised {type(exc).__name__}; worker.reward.memory_limit_mb caps it)\n{tb}"
    return f"raised {type(exc).__name__}: {exc}\n{tb}"


def _as_float(value: Any) -> float | None:
    """A real number as float (ints, floats, numpy/torch scalars); None for anything else."""
    if not isinstance(value, numbers.Real):
        # 0-d numpy arrays / torch tensors expose .item(); checked without importing either library.
        item = getattr(value, "item", None)
        if not callable(item) or getattr(value, "ndim", None) != 0:
            return None
        try:
            value = item()
        except Exception:
            return None
        if not isinstance(value, numbers.Real):
            return None
    try:
        return float(value)
    except OverflowError:  # an int too large for a float: reported as not finite
        return math.inf
    except Exception:
        return None


def check_score(obj: Any) -> Outcome:
    """Validate one returned score: a dict with `overall`, every value a finite real number."""
    if not isinstance(obj, Mapping):
        return RewardFailure(f"returned a {type(obj).__name__} ({_short(obj)}), expected a dict of floats")
    if "overall" not in obj:
        return RewardFailure(f"returned a dict without 'overall' (keys: {sorted(map(str, obj))})")
    scores: dict[str, float] = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            return RewardFailure(f"returned a dict with a non-string key {key!r}")
        number = _as_float(value)
        if number is None:
            return RewardFailure(f"returned {key}={_short(value)} ({type(value).__name__}), not a number")
        if not math.isfinite(number):
            return RewardFailure(f"returned {key}={number} (not finite)")
        scores[key] = number
    return scores


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def call_one(loaded: LoadedReward, kwargs: Mapping[str, Any], sample: RewardInput) -> Outcome:
    """Sequential reward: call the function on one sample and check its dict."""
    try:
        out = loaded.fn(sample, **kwargs)
    except Exception as exc:
        return RewardFailure(describe_exception(exc, skip_frames=1))
    except SystemExit as exc:  # sys.exit() inside a reward must not take the worker down silently
        return RewardFailure(f"called sys.exit({exc.code})")
    return check_score(out)


def call_batch(
    loaded: LoadedReward, kwargs: Mapping[str, Any], samples: Sequence[RewardInput]
) -> list[Outcome] | RewardFailure:
    """Batch reward: one call for the chunk. A failure of the call itself fails the whole chunk."""
    try:
        out = loaded.fn(list(samples), **kwargs)
    except Exception as exc:
        return RewardFailure(describe_exception(exc, skip_frames=1))
    except SystemExit as exc:
        return RewardFailure(f"called sys.exit({exc.code})")
    if isinstance(out, (str, bytes, Mapping)) or not isinstance(out, Sequence):
        return RewardFailure(f"returned a {type(out).__name__}, expected a list of {len(samples)} dicts")
    if len(out) != len(samples):
        return RewardFailure(f"returned {len(out)} results for {len(samples)} inputs")
    return [check_score(item) for item in out]


def guarded(call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)`, turning an unexpected error in our own checks into a reported failure."""
    try:
        return call(*args)
    except Exception as exc:  # every job must get an answer, or the parent waits for the timeout
        return RewardFailure(f"returned a result that could not be checked: {describe_exception(exc)}")
