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

from vlrl.batch.held import Held
from vlrl.batch.rows import RolloutBatch, SampleBatch

# Driver-side [N, R] fields, padded together when samples of different response widths are joined.
SAMPLE_RESPONSE_FIELDS = (
    "responses", "response_mask", "token_level_scores", "token_level_rewards", "old_log_probs",
    "ref_log_probs", "advantages", "returns",
)  # fmt: skip


@dataclass
class StepSamples(SampleBatch):
    """N samples (group members adjacent), R = longest response. The reward function reads the
    responses, so their token ids come to the driver; nothing else of the sequences does."""

    responses: torch.Tensor  # [N, R] response token ids, right-padded with the pad id
    response_mask: torch.Tensor  # [N, R] 1 up to and including the first EOS (multi-turn: sampled tokens)
    group_ids: torch.Tensor  # [N] samples of one prompt share an id
    prompt_lengths: torch.Tensor  # [N] the prompt's tokens
    turn_lengths: torch.Tensor  # [N] tokens after the prompt (multi-turn: every turn, tool results too)
    prompts: list[str]
    ground_truths: list[Any]
    extras: list[dict[str, Any]]
    held: list[tuple[Held, int] | None]  # per row: its published batch and index there; None: not kept
    trajectories: list[dict[str, Any]] | None = None  # multi-turn: turns, tool calls, the final answer
    # Filled on the driver:
    token_level_scores: torch.Tensor | None = None  # [N, R] reward on the last response token
    token_level_rewards: torch.Tensor | None = None  # [N, R] scores minus the KL penalty (if in reward)
    old_log_probs: torch.Tensor | None = None  # [N, R] only when the KL penalty is in the reward
    ref_log_probs: torch.Tensor | None = None  # [N, R] likewise
    advantages: torch.Tensor | None = None  # [N, R]
    returns: torch.Tensor | None = None  # [N, R]
    reward_parts: list[dict[str, float]] | None = None

    @classmethod
    def of(cls, batch: RolloutBatch, held: Held | None) -> StepSamples:
        """The driver's view of `batch`, whose rows are held at `held` (None: not kept anywhere)."""
        p = batch.prompt_length
        return cls(
            responses=batch.responses, response_mask=batch.response_mask, group_ids=batch.group_ids,
            prompt_lengths=batch.attention_mask[:, :p].sum(-1), turn_lengths=batch.attention_mask[:, p:].sum(-1),
            prompts=batch.prompts, ground_truths=batch.ground_truths, extras=batch.extras,
            held=[None if held is None else (held, i) for i in range(len(batch))],
            trajectories=batch.trajectories,
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
        width = max(p.responses.shape[1] for p in parts)
        return cls.concat([_pad_responses(p, width, pad_token_id) for p in parts])


def _pad_responses(samples: StepSamples, width: int, pad_id: int) -> StepSamples:
    right = width - samples.responses.shape[1]
    if right == 0:
        return samples
    padded: dict[str, Any] = {
        name: F.pad(value, (0, right), value=pad_id if name == "responses" else 0)
        for name in SAMPLE_RESPONSE_FIELDS
        if (value := getattr(samples, name)) is not None
    }
    return replace(samples, **padded)
