"""What the driver holds of a step's samples: per-sample values, and where each row is held.

The driver scores, filters and computes advantages on `StepSamples`; the rows themselves (prompt
and response ids, positions, images, the engine's log-probs) stay in the generating rank's
published batch (`vlrl.batch.held`), and the training ranks take them from there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from vlrl.batch.held import Held, TakePlan, plan_runs
from vlrl.batch.rows import RolloutBatch, SampleBatch, narrow, widen

# Driver-side [N, R] fields, padded together when samples of different response widths are joined.
SAMPLE_RESPONSE_FIELDS = ("responses", "response_mask", "token_level_scores", "advantages")


@dataclass
class StepSamples(SampleBatch):
    """N samples (group members adjacent), R = longest response. The generating ranks score their
    rows (`vlrl.workers.scoring`), so the driver gets each sample's reward parts and no token ids;
    the response ids come only when the driver needs them (a reward that must see the whole batch
    at once, the generations validation logs).

    Pickled (a generating rank's report to the driver), `responses` and `response_mask` travel
    ragged (`Ragged`: each row's first `turn_lengths` entries, the padding left out), so their bytes
    follow the tokens generated rather than N x the longest response."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name, fill in (("responses", None), ("response_mask", 0)):
            value = getattr(self, name)
            packed = None if value is None else Ragged.pack(value, self.turn_lengths, fill)
            if packed is not None:
                state[name] = packed
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__({k: v.unpack() if isinstance(v, Ragged) else v for k, v in state.items()})

    responses: torch.Tensor | None  # [N, R] response token ids, right-padded with the pad id; None: not sent
    response_mask: torch.Tensor  # [N, R] 1 up to and including the first EOS (multi-turn: sampled tokens)
    group_ids: torch.Tensor  # [N] samples of one prompt share an id
    prompt_lengths: torch.Tensor  # [N] the prompt's tokens
    turn_lengths: torch.Tensor  # [N] tokens after the prompt (multi-turn: every turn, tool results too)
    prompts: list[str]
    ground_truths: list[Any]
    extras: list[dict[str, Any]]
    held: list[tuple[Held, int] | None]  # per row: its published batch and index there; None: not kept
    trajectories: list[dict[str, Any]] | None = None  # multi-turn: turns, tool calls, the final answer
    prompt_width: int = 0  # P of the batches the rows are held in (joined: the widest)
    # [N, 3] float, asynchronous mode: each response's first token's policy version, its tokens'
    # mean version, and how many of its tokens a newer policy than the first sampled (partial rollouts)
    version_stats: torch.Tensor | None = None
    busy_clock: tuple[float, float] | None = None  # the generating rank's (busy, wall) seconds (BusyClock)
    # Filled on the driver:
    token_level_scores: torch.Tensor | None = None  # [N, R] reward on the last response token
    sequence_rewards: torch.Tensor | None = None  # [N] each response's rewards summed (KL penalty included)
    advantages: torch.Tensor | None = None  # [N, R]
    reward_parts: list[dict[str, float]] | None = None  # per sample: filled where the rows are scored
    reward_failures: int = 0  # samples whose reward failed (scored 0 with worker.reward.on_failure=zero)
    reward_wait_s: float = 0.0  # a rank's wait for its rewards after generation ended (merged: the longest)

    @classmethod
    def of(cls, batch: RolloutBatch, held: Held | None, with_responses: bool = True) -> StepSamples:
        """The driver's view of `batch`, whose rows are held at `held` (None: not kept anywhere);
        without `with_responses` the response ids stay behind."""
        p = batch.prompt_length
        return cls(
            responses=batch.responses if with_responses else None, response_mask=batch.response_mask, group_ids=batch.group_ids,
            prompt_lengths=batch.attention_mask[:, :p].sum(-1), turn_lengths=batch.attention_mask[:, p:].sum(-1),
            prompts=batch.prompts, ground_truths=batch.ground_truths, extras=batch.extras,
            held=[None if held is None else (held, i) for i in range(len(batch))],
            trajectories=batch.trajectories, prompt_width=batch.prompt_length,
            version_stats=None if batch.rollout_versions is None else version_stats(batch),
        )  # fmt: skip

    def scored_parts(self) -> list[dict[str, float]]:
        """Per-sample reward parts, which the reward stage fills."""
        if self.reward_parts is None:
            raise ValueError("the samples have no reward parts yet: they have not been scored")
        return self.reward_parts

    @property
    def sequence_lengths(self) -> torch.Tensor:
        """[N] tokens of each sample's whole sequence (what token balancing evens out)."""
        return self.prompt_lengths + self.turn_lengths

    @classmethod
    def join(cls, parts: list[StepSamples], pad_token_id: int) -> StepSamples:
        """The samples of `parts` in order, their [N, R] fields padded to the widest response."""
        parts = [p for p in parts if len(p) > 0] or parts[:1]
        width = max(p.response_mask.shape[1] for p in parts)
        joined = cls.concat([_pad_responses(p, width, pad_token_id) for p in parts])
        return replace(joined, prompt_width=max(p.prompt_width for p in parts))

    def plan(self, rows: list[int]) -> TakePlan:
        """How a rank takes `rows` of these samples from where they are held, at the step's widths."""
        return TakePlan(plan_runs(self.held, rows), self.prompt_width, self.response_mask.shape[1])


def version_stats(batch: RolloutBatch) -> torch.Tensor:
    """[N, 3] per response: the version of its first token, the mean over its tokens, and the count
    of its tokens sampled by a newer policy than the first (`StepSamples.version_stats`)."""
    versions, mask = batch.tensor("rollout_versions"), batch.response_mask.bool()  # [N, R]
    tokens = mask.sum(-1).clamp(min=1)
    first = versions[:, 0]
    mean = (versions * mask).sum(-1) / tokens
    newer = ((versions > first.unsqueeze(-1)) & mask).sum(-1)
    return torch.stack([first.double(), mean.double(), newer.double()], dim=-1).float()


@dataclass(frozen=True)
class Ragged:
    """An [N, W] tensor as its rows' leading `lengths[i]` entries (flat, in the narrowest exact
    dtype; or one number when they are all equal, as a mask without holes) and the one value every
    other entry holds; `unpack` gives it back exactly."""

    values: Any  # [sum(lengths)] (a `Narrowed` int64 tensor in transit), or the one value they all have
    lengths: Any  # [N]
    width: int
    fill: float | int
    dtype: torch.dtype

    @classmethod
    def pack(cls, x: torch.Tensor, lengths: torch.Tensor, fill: float | int | None) -> Ragged | None:
        """`x` [N, W] ragged by `lengths` [N], or None when that would not be exact (the entries past
        a row's length are not all `fill`; None: the value of the first such entry) or gains nothing."""
        inside = torch.arange(x.shape[1]) < lengths.unsqueeze(-1)  # [N, W]
        outside = x[~inside]
        if outside.numel() == 0:
            return None
        fill = outside[0].item() if fill is None else fill
        if not bool((outside == fill).all()):
            return None
        values = x[inside]
        same = values.numel() > 0 and bool((values == values[0]).all())
        return cls(values[0].item() if same else narrow(values), narrow(lengths), x.shape[1], fill, x.dtype)

    def unpack(self) -> torch.Tensor:
        lengths = widen(self.lengths)
        out = torch.full((len(lengths), self.width), self.fill, dtype=self.dtype)
        inside = torch.arange(self.width) < lengths.unsqueeze(-1)
        out[inside] = (
            self.values if isinstance(self.values, (int, float)) else widen(self.values).to(self.dtype)
        )
        return out


def _pad_responses(samples: StepSamples, width: int, pad_id: int) -> StepSamples:
    right = width - samples.response_mask.shape[1]
    if right == 0:
        return samples
    padded: dict[str, Any] = {
        name: F.pad(value, (0, right), value=pad_id if name == "responses" else 0)
        for name in SAMPLE_RESPONSE_FIELDS
        if (value := getattr(samples, name)) is not None
    }
    return replace(samples, **padded)
