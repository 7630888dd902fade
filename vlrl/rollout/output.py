"""Turn an engine's sampled token lists into a `RolloutBatch` (shared by every engine, pure tensors).

Shapes: B prompts, n samples each, N = B * n rows (a prompt's samples adjacent), P = prompt width
(left-padded), R = longest response in the batch (right-padded with the pad id).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from vlrl.batch.rows import PromptBatch, RolloutBatch
from vlrl.models.rope import continue_position_ids


def pad_responses(responses: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, R] right-padded ids, [N] lengths); R = max(1, longest) so the tensor is never empty-wide."""
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
    width = max(1, int(lengths.max())) if len(responses) else 1
    out = torch.full((len(responses), width), pad_token_id, dtype=torch.long)
    for row, tokens in enumerate(responses):
        out[row, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.long)
    return out, lengths


def response_mask_from_eos(
    responses: torch.Tensor, lengths: torch.Tensor, eos_token_ids: Collection[int]
) -> torch.Tensor:
    """[N, R] long: 1 on generated tokens up to and including the first EOS, 0 after it and on padding."""
    columns = torch.arange(responses.shape[1], device=responses.device)
    generated = columns.unsqueeze(0) < lengths.unsqueeze(1)  # [N, R]
    eos = torch.isin(responses, torch.as_tensor(sorted(eos_token_ids), device=responses.device)) & generated
    # Count EOS tokens strictly before each column: > 0 means the sequence already ended.
    ended = (eos.long().cumsum(-1) - eos.long()) > 0
    return (generated & ~ended).long()


def pad_log_probs(log_probs: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """[N, width] float32, 0 on padding."""
    out = torch.zeros((len(log_probs), width), dtype=torch.float32)
    for row, values in enumerate(log_probs):
        out[row, : len(values)] = torch.as_tensor(list(values), dtype=torch.float32)
    return out


def assemble_rollout_batch(
    prompts: PromptBatch,
    responses: Sequence[Sequence[int]],
    n: int,
    pad_token_id: int,
    eos_token_ids: Collection[int],
    log_probs: Sequence[Sequence[float]] | None = None,
    versions: Sequence[Sequence[int]] | None = None,
) -> RolloutBatch:
    """The `RolloutBatch` of `prompts` with `responses` (N = len(prompts) * n lists, groups adjacent);
    `log_probs` and `versions` (the policy version that sampled each token), one list per response."""
    if len(responses) != len(prompts) * n:
        raise ValueError(f"expected {len(prompts)} x {n} responses, got {len(responses)}")
    expanded = prompts.repeat_interleave(n)  # every per-prompt field, each row n times
    response_ids, lengths = pad_responses(responses, pad_token_id)  # [N, R], [N]
    response_mask = response_mask_from_eos(response_ids, lengths, eos_token_ids)  # [N, R]
    width = response_ids.shape[1]
    prompt_pos = expanded.position_ids  # [N, P] or [N, 3, P]
    response_pos = continue_position_ids(prompt_pos, width)  # [N, R] or [N, 3, R]
    return RolloutBatch(
        input_ids=torch.cat([expanded.input_ids, response_ids], dim=-1),
        attention_mask=torch.cat([expanded.attention_mask, response_mask], dim=-1),
        position_ids=torch.cat([prompt_pos, response_pos], dim=-1),
        responses=response_ids,
        response_mask=response_mask,
        group_ids=torch.as_tensor(list(expanded.uids), dtype=torch.long),
        prompt_length=int(prompts.input_ids.shape[1]),
        images=expanded.images,
        videos=expanded.videos,
        prompts=expanded.prompts,
        ground_truths=expanded.ground_truths,
        extras=expanded.extras,
        rollout_log_probs=None if log_probs is None else pad_log_probs(log_probs, width),
        rollout_versions=None if versions is None else pad_responses(versions, 0)[0][:, :width],
    )
