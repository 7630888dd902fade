"""Typed batches passed between the stages of a step.

    dataloader -> PromptBatch -> rollout -> RolloutBatch -> rewards / log-probs / update

Every field is either a tensor whose first dimension is the batch, or a list with one entry per
sample. `SampleBatch` gives both kinds the same row operations (select, chunk, concat, repeat),
so a reordering or split always moves every field together and nothing is keyed by strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

import torch

B = TypeVar("B", bound="SampleBatch")


@dataclass
class SampleBatch:
    """Row operations shared by the batch dataclasses. Fields that are None are carried as None.

    Pickled (Ray's transport between the driver and the ranks, checkpoints of a prefetched batch),
    int64 tensors travel in the narrowest exact dtype (`narrow`): 0/1 masks as bool, token ids and
    positions as int32, and come back as int64, so a batch crosses in about half the bytes and
    arrives equal to what was sent."""

    def __getstate__(self) -> dict[str, Any]:
        return {name: narrow(value) for name, value in self.__dict__.items()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({name: widen(value) for name, value in state.items()})

    def __len__(self) -> int:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (torch.Tensor, list)):
                return len(value)
        return 0

    def tensor(self, name: str) -> torch.Tensor:
        """Field `name`, which an earlier stage must have filled (optional fields start as None)."""
        value = getattr(self, name)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"the batch has no {name!r} yet: the stage that fills it has not run")
        return value

    def select(self: B, index: torch.Tensor | list[int]) -> B:
        """Rows `index` (a list of ints or a 1-D long/bool tensor), in that order."""
        if isinstance(index, torch.Tensor):
            index = index.nonzero().flatten().tolist() if index.dtype == torch.bool else index.tolist()
        rows = list(index)
        picked: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                picked[f.name] = value[torch.as_tensor(rows, dtype=torch.long)]
            elif isinstance(value, list):
                picked[f.name] = [value[i] for i in rows]
        return replace(self, **picked)

    def chunk(self: B, chunks: int) -> list[B]:
        """Split into `chunks` contiguous, equal parts (the length must divide evenly)."""
        n = len(self)
        if n % chunks:
            raise ValueError(f"cannot split a batch of {n} rows into {chunks} equal chunks")
        size = n // chunks
        return [self.select(list(range(i * size, (i + 1) * size))) for i in range(chunks)]

    def repeat_interleave(self: B, repeats: int) -> B:
        """Each row repeated `repeats` times, copies adjacent (a GRPO group stays contiguous)."""
        return self.select([i for i in range(len(self)) for _ in range(repeats)])

    @classmethod
    def concat(cls: type[B], batches: list[B]) -> B:
        """Rows of all `batches` in order. Tensors must share trailing shapes (pad first)."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        merged: dict[str, Any] = {}
        for f in fields(batches[0]):
            values = [getattr(b, f.name) for b in batches]
            if isinstance(values[0], torch.Tensor):
                merged[f.name] = torch.cat(values, dim=0)
            elif isinstance(values[0], list):
                merged[f.name] = [item for value in values for item in value]
            else:
                merged[f.name] = values[0]
        return replace(batches[0], **merged)


@dataclass(frozen=True)
class Narrowed:
    """An int64 tensor stored in a narrower dtype for transport; `widen` gives it back exactly."""

    values: torch.Tensor


_INT32 = torch.iinfo(torch.int32)


def narrow(value: Any) -> Any:
    """An int64 tensor as `Narrowed` (bool when every value is 0 or 1, int32 when all fit); anything
    else as it is."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.numel() == 0:
        return value
    low, high = int(value.min()), int(value.max())
    if low >= 0 and high <= 1:
        return Narrowed(value.to(torch.bool))
    if low >= _INT32.min and high <= _INT32.max:
        return Narrowed(value.to(torch.int32))
    return value


def widen(value: Any) -> Any:
    return value.values.to(torch.int64) if isinstance(value, Narrowed) else value


@dataclass
class PromptBatch(SampleBatch):
    """Prompts from the dataloader. P = longest prompt in the batch (after image tokens expand)."""

    input_ids: torch.Tensor  # [B, P] long, left-padded, image placeholders expanded
    attention_mask: torch.Tensor  # [B, P] long, 1 on real tokens
    position_ids: torch.Tensor  # [B, P] (text models) or [B, 3, P] (mrope: temporal, height, width)
    raw_prompt_ids: list[list[int]]  # unexpanded ids (one <|image_pad|> per image) for the rollout engine
    # per prompt ([] if none): from the loader, encoded files with the size the model sees
    # (vlrl.data.encoded_images.EncodedImage); on a rank once fetched, RGB PIL images of that size
    images: list[list[Any]]
    prompts: list[str]  # the rendered prompt text (chat template applied), for rewards and logs
    ground_truths: list[Any]  # answer column per prompt
    extras: list[dict[str, Any]]  # every other dataset column, passed to the reward function
    uids: list[int]  # a unique id per prompt: becomes the group id of its n responses
    videos: list[list[Any]] | None = (
        None  # vlrl.data.video.Video per prompt ([] if none); None: no video field
    )


@dataclass
class RolloutBatch(SampleBatch):
    """Prompts with their sampled responses. N = prompts x n (group members adjacent), R = longest response."""

    input_ids: torch.Tensor  # [N, P + R] prompt (left-padded) + response (right-padded)
    attention_mask: torch.Tensor  # [N, P + R]
    position_ids: torch.Tensor  # [N, P + R] or [N, 3, P + R]; response positions continue the prompt's
    responses: torch.Tensor  # [N, R] response token ids, right-padded with the pad id
    response_mask: torch.Tensor  # [N, R] 1 up to and including the first EOS
    group_ids: torch.Tensor  # [N] long: samples of one prompt share an id
    prompt_length: int  # P: the response starts at column P of input_ids
    images: list[list[Any]]
    prompts: list[str]
    ground_truths: list[Any]
    extras: list[dict[str, Any]]
    rollout_log_probs: torch.Tensor | None = None  # [N, R] engine's log-probs of the sampled tokens
    # [N, R] long: the policy version (trainer updates done) that sampled each token; asynchronous
    # mode's rollout ranks only (with partial rollouts one response can span several versions)
    rollout_versions: torch.Tensor | None = None
    # Multi-turn rollouts: per sample, the turns, tool calls and counters (vlrl.rollout.multi_turn);
    # response_mask is then 1 on sampled tokens only, attention_mask on every trajectory token.
    trajectories: list[dict[str, Any]] | None = None
    videos: list[list[Any]] | None = None  # per sample, like `images` (vlrl.data.video.Video)
    # Filled on the rank that trains on the row (the driver scores `StepSamples`, vlrl.batch.samples):
    old_log_probs: torch.Tensor | None = None  # [N, R] actor before the update
    ref_log_probs: torch.Tensor | None = None  # [N, R] reference policy
    advantages: torch.Tensor | None = None  # [N, R] spread from the driver's per-sample values


# Every tensor field of RolloutBatch by the width of its last dimension, so that padding two
# batches to common widths moves all of them (tests/trainer/test_dispatch.py checks that each
# tensor field is in exactly one of these; a new [N, R] field must be added here).
SEQUENCE_FIELDS = ("input_ids", "attention_mask", "position_ids")  # [..., P + R]
RESPONSE_FIELDS = (  # [N, R]
    "responses", "response_mask", "rollout_log_probs", "rollout_versions", "old_log_probs", "ref_log_probs",
    "advantages",
)  # fmt: skip
PER_ROW_FIELDS = ("group_ids",)  # [N]
TOKEN_ID_FIELDS = ("input_ids", "responses")  # padded with the pad token id; the rest with 0


@dataclass(frozen=True)
class TokenRewards:
    """What a rank needs to compute a token-level estimator's advantages (REINFORCE++) on the rows
    it holds: each row's score, the discount and, when the KL penalty is in the reward, this step's
    coefficient and estimator. The whitening's sums are added up over the ranks (all-reduce)."""

    estimator: str
    scores: torch.Tensor  # [rows] each row's overall score
    gamma: float
    kl_coef: float | None = None  # None: no KL penalty in the reward
    kl_kind: str = ""
    kl_low_var_clamp: float | None = None  # the k3 bound the trainer passes (low_var_kl_clamp)


@dataclass
class KeptRows:
    """An update's shard when the rank already holds its rows (kept by the log-prob pass): their ids
    and the columns the driver computed since, each either per token, e.g. {"advantages": [rows, R]},
    or, in `per_row`, one value per row [rows] that the rank spreads over the row's response tokens
    (`spread_over_response`): an outcome estimator's advantages cross as 4 bytes a sample. A
    token-level estimator's advantages are computed on the rank from `token_rewards` instead."""

    rows: list[int]
    columns: dict[str, torch.Tensor]
    per_row: dict[str, torch.Tensor] = field(default_factory=dict)
    token_rewards: TokenRewards | None = None


def one_value_per_row(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor | None:
    """values [N, R] as [N] when every row is one value on its response tokens and 0 elsewhere,
    so that `spread_over_response` gives back exactly `values`; else None."""
    first = response_mask.to(torch.long).argmax(-1, keepdim=True)  # [N, 1] a valid column of each row
    per_row = values.gather(-1, first).squeeze(-1)  # [N]
    return per_row if torch.equal(spread_over_response(per_row, response_mask), values) else None


def spread_over_response(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N] -> [N, R]: each row's value on its response tokens, 0 elsewhere (as the outcome
    estimators spread one advantage per sequence)."""
    return per_row.unsqueeze(-1) * response_mask.to(per_row.dtype)


@dataclass
class FinishedGroups:
    """Groups whose samples have all ended, reported by an engine while the rest of its shard is
    still generating (streamed rewards start on them at once; the shard's `RolloutBatch` follows).

    `prompt_rows`: positions in the shard's `PromptBatch`; `responses`: the sampled token ids,
    `len(responses) // len(prompt_rows)` per prompt, prompt-major (as the batch's rows)."""

    prompt_rows: list[int]
    responses: list[list[int]]
