"""Rows held where they were generated: the driver sees `StepSamples`, the ranks take rows by reference.

A generating rank publishes each `RolloutBatch` it makes (`publish`: `ray.put` under Ray, so the
object stays in its node's object store; in-process, the batch itself) and returns the driver
only a `StepSamples`: per-sample values and, per row, where the row is held. After scoring and
filtering, the driver sends each training rank a `TakePlan` (which rows of which published batch,
in order); the rank `take`s them, fetching from the object store directly, so prompt and response
tensors never pass through the driver. A hybrid rank mostly takes back rows it generated itself
(its own node's store); the rows token balancing moves, and in asynchronous mode all rows, come
from another rank's store.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from vlrl.batch.rows import RESPONSE_FIELDS, SEQUENCE_FIELDS, TOKEN_ID_FIELDS, RolloutBatch


@dataclass(frozen=True, eq=False)
class Held:
    """One published `RolloutBatch`: `handle` is a `ray.ObjectRef` under Ray, else the batch."""

    handle: Any

    def fetch(self) -> RolloutBatch:
        if isinstance(self.handle, RolloutBatch):
            return self.handle
        import ray

        return ray.get(self.handle)


def publish(batch: RolloutBatch) -> Held:
    """`batch` where other processes can fetch it: Ray's object store when Ray runs here."""
    try:
        import ray
    except ImportError:  # the GPU acceptance check's machines have no Ray
        return Held(batch)
    return Held(ray.put(batch) if ray.is_initialized() else batch)


class Holdings:
    """The batches a generating rank published and must keep alive (it owns their object-store
    entries) until the step that trains on them took its rows. The one rule: a batch for step s
    may be taken up to `lag` steps later, so generating for step t drops what was published for
    steps before t - lag. A hybrid rank's rows are taken within their step (lag 0); a rollout
    rank's (asynchronous mode) up to `max_staleness` steps later (it generates for step s + k
    during step s)."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.published: list[tuple[int, Held]] = []  # (step, batch), oldest first

    def keep(self, held: Held, step: int) -> Held:
        """Hold `held`, published for `step`, and drop what no step can still take."""
        self.published = [(s, h) for s, h in self.published if s >= step - self.lag] + [(step, held)]
        return held


@dataclass(frozen=True)
class TakePlan:
    """A rank's rows of one step, in order: `runs` of (published batch, its row indices), and the
    step's widths every row is padded to (`prompt_width` P, `response_width` R: the widest of the
    step's published batches, so a rank's tensors have the shapes whatever rows it gets)."""

    runs: list[tuple[Held, list[int]]]
    prompt_width: int
    response_width: int


def plan_runs(held: list[tuple[Held, int] | None], rows: list[int]) -> list[tuple[Held, list[int]]]:
    """The runs for `rows` of a step whose row i is held at `held[i]` (batch, index): consecutive
    rows from one batch form one run."""
    plan: list[tuple[Held, list[int]]] = []
    for row in rows:
        where = held[row]
        if where is None:
            raise ValueError(f"row {row} is not held anywhere (generated without publish)")
        source, index = where
        if plan and plan[-1][0] is source:
            plan[-1][1].append(index)
        else:
            plan.append((source, [index]))
    return plan


def take(plan: TakePlan, pad_token_id: int) -> RolloutBatch:
    """The planned rows as one batch (each published batch fetched once), padded to the plan's widths."""
    fetched: dict[int, RolloutBatch] = {}
    parts = []
    for source, index in plan.runs:
        if id(source) not in fetched:
            fetched[id(source)] = source.fetch()
        parts.append(fetched[id(source)].select(index))
    return concat_padded(parts, pad_token_id, (plan.prompt_width, plan.response_width))


def concat_padded(
    batches: list[RolloutBatch], pad_token_id: int, widths: tuple[int, int] | None = None
) -> RolloutBatch:
    """The rows of `batches` in order, each padded to `widths` (prompt part, response part; by
    default the widest of `batches`)."""
    parts = [b for b in batches if len(b) > 0] or batches[:1]
    width_p, width_r = widths or (
        max(b.prompt_length for b in parts),
        max(b.responses.shape[1] for b in parts),
    )
    padded = [pad_rollout(b, width_p, width_r, pad_token_id) for b in parts]
    return padded[0] if len(padded) == 1 else RolloutBatch.concat(padded)


def pad_rollout(batch: RolloutBatch, width_p: int, width_r: int, pad_id: int) -> RolloutBatch:
    """Left-pad the prompt part to `width_p` and right-pad the response part to `width_r`, in every
    tensor field (by its kind in `vlrl.batch.rows`: [..., P + R] or [N, R])."""
    left, right = width_p - batch.prompt_length, width_r - batch.responses.shape[1]
    if left == 0 and right == 0:
        return batch
    p = batch.prompt_length

    def both(x: torch.Tensor, value: float) -> torch.Tensor:  # [..., P + R] -> [..., P' + R']
        return torch.cat(
            [F.pad(x[..., :p], (left, 0), value=value), F.pad(x[..., p:], (0, right), value=value)], -1
        )

    padded: dict[str, Any] = {}
    for names, pad in (
        (SEQUENCE_FIELDS, both),
        (RESPONSE_FIELDS, lambda x, v: F.pad(x, (0, right), value=v)),
    ):
        for name in names:
            value = getattr(batch, name)
            if value is not None:
                padded[name] = pad(value, pad_id if name in TOKEN_ID_FIELDS else 0)
    return replace(batch, prompt_length=width_p, **padded)
