"""Data types shared by the reward loader, the runner and the reward functions themselves.

This module is imported inside the reward worker processes, so it must stay light (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlrl.user_code.loading import UserCodeError

RESERVED_KEYS = ("response", "response_length", "ground_truth", "prompt")
"""Keys every `RewardInput` has; an extra dataset column with one of these names becomes `extra_<name>`."""


class RewardError(RuntimeError):
    """A reward function failed (raised, hung, or returned something unusable)."""


class RewardLoadError(RewardError, UserCodeError):
    """A reward function could not be loaded (missing file, import error, missing function...)."""


class RewardInput(dict):
    """One sample handed to a reward function: a `dict` that also allows attribute access.

    Keys: `response` (decoded text), `response_length` (tokens), `ground_truth`, `prompt`, plus every
    extra dataset column. `inp["response"]` and `inp.response` are the same thing.
    """

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails; dunder names must raise so pickle/copy behave.
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"RewardInput has no key {name!r}; keys: {sorted(self)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"RewardInput({dict.__repr__(self)})"


def _merge_extras(sample: RewardInput, extras: Mapping[str, Any]) -> None:
    """Add extra columns; names that collide with a reserved key are exposed as `extra_<name>`."""
    for key, value in extras.items():
        name = f"extra_{key}" if key in RESERVED_KEYS else key
        if name in sample:
            raise ValueError(f"extra column {key!r} would be exposed as {name!r}, which is already taken")
        sample[name] = value


def build_reward_inputs(
    responses: Sequence[str],
    response_lengths: Sequence[int],
    prompts: Sequence[str],
    ground_truths: Sequence[Any],
    extras: Sequence[Mapping[str, Any]] | None = None,
) -> list[RewardInput]:
    """Zip per-sample fields into `RewardInput`s (extras: one dict of extra columns per sample)."""
    n = len(responses)
    extras = extras if extras is not None else [{}] * n
    lengths = {len(response_lengths), len(prompts), len(ground_truths), len(extras)}
    if lengths != {n}:
        raise ValueError(
            f"build_reward_inputs: lengths differ (responses={n}, response_lengths={len(response_lengths)}, "
            f"prompts={len(prompts)}, ground_truths={len(ground_truths)}, extras={len(extras)})"
        )
    inputs = []
    for i in range(n):
        sample = RewardInput(
            response=responses[i],
            response_length=int(response_lengths[i]),
            ground_truth=ground_truths[i],
            prompt=prompts[i],
        )
        _merge_extras(sample, extras[i])
        inputs.append(sample)
    return inputs


@dataclass
class RewardFailure:
    """Why one sample (or a whole chunk of samples) could not be scored; produced by the checks."""

    reason: str
    chunk: tuple[int, int] | None = None
    """(first, last) sample indices when the failure is not attributable to one sample."""

    @property
    def out_of_memory(self) -> bool:
        """The reward raised MemoryError (`describe_exception`'s wording): its worker is replaced."""
        return self.reason.startswith("ran out of memory")


@dataclass
class RewardResult:
    """Scores of one `RewardRunner.score` call, in input order.

    Every dict has the same keys, `overall` included: a part missing from some samples (and every
    part of a failed sample) is 0.0.
    """

    scores: list[dict[str, float]]
    failures: int = 0
    """Number of samples that failed (scored 0 with `on_failure=zero`)."""
    failure_messages: list[str] = field(default_factory=list)
    """What went wrong, one message per failed call (at most 20)."""

    @property
    def overall(self) -> list[float]:
        """The `overall` score of every sample."""
        return [s["overall"] for s in self.scores]

    def parts(self) -> list[str]:
        """Part names, `overall` first then alphabetical."""
        names = {k for s in self.scores for k in s}
        return ["overall", *sorted(names - {"overall"})] if self.scores else []

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """`<prefix>/<part>` mean over the samples for every part, plus `<prefix>/failures` (a count)."""
        out: dict[str, float] = {}
        n = len(self.scores)
        for name in self.parts():
            out[f"{prefix}/{name}"] = math.fsum(s[name] for s in self.scores) / n
        out[f"{prefix}/failures"] = float(self.failures)
        return out
