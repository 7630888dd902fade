"""The distribution rollouts sample from, defined once for the engines and the actor/reference.

Both engines sample a response token from

    pi(v) = softmax(z)[v],   z = logits / temperature,   z[b] = -inf for every banned token b

(banned: the vision placeholders and brackets, which only the processor may place). The actor and
the reference score responses on exactly this distribution: the log-probs of the ratio and of the
KL, the entropy metric and the entropy bonus. Scoring on the unbanned logits instead describes a
policy that never generated the data: an entropy bonus then spreads probability onto banned
tokens that are never sampled, so no loss term ever pushes it back, until the sampled policy
turns deterministic and every group's rewards are equal (a long quickstart collapsed that way).

top-k / top-p are *not* part of this distribution. They renormalize over a support that depends on
the logits themselves, so under the current policy a token sampled by the old one may fall
outside the support (log-prob -inf, ratio 0, no gradient), and the entropy of a truncated
distribution rewards moving mass inside the nucleus only. The engines still apply them when set,
and their returned log-probs then include the renormalization, so `rollout/log_prob_diff_*`
grows by that amount; the trainer warns at start-up (see `truncation_warning`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# Tokens that only the processor may place (image/video placeholders and their brackets): a sampled
# one would make the sequence unreadable for the vision pipeline, so engines never generate them.
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
_VISION_ID_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")

# What a banned logit becomes when scoring. Finite (unlike the engines' -inf) so that p * z is
# 0 * finite = 0 in the entropy and its gradient, never 0 * inf = nan; exp(BANNED - lse) is exactly 0
# in fp32 for any realistic lse, so the distribution is the engines' one.
BANNED_LOGIT = -1e30


def banned_token_ids(tokenizer: Any, hf_config: Any | None = None) -> list[int]:
    """Vision placeholder/bracket ids that are never sampled (from the config, else the vocabulary).

    `tokenizer` may be a processor (its `.tokenizer` is used) or None."""
    ids: set[int] = set()
    for key in _VISION_ID_KEYS:
        value = getattr(hf_config, key, None) if hf_config is not None else None
        if value is None:
            value = getattr(getattr(hf_config, "text_config", None), key, None)
        if value is not None:
            ids.add(int(value))
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    names: tuple[str, ...] = VISION_TOKENS
    if hf_config is not None:
        from vlrl.models.families import family_of

        names += family_of(hf_config).banned_tokens
    ids.update(int(vocab[token]) for token in names if token in vocab)
    return sorted(ids)


@dataclass(frozen=True)
class SamplingDistribution:
    """softmax((logits with `banned_token_ids` removed) / temperature): what the engines sample from."""

    temperature: float = 1.0
    banned_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(
                f"temperature={self.temperature}: log-probs are only defined for sampled (temperature > 0) "
                "rollouts; greedy responses cannot be trained on"
            )

    def scores(self, logits: Tensor) -> Tensor:
        """z: logits [M, V] (any float dtype) -> [M, V] fp32, banned columns at BANNED_LOGIT.

        Out-of-place: the caller's logits are never modified."""
        z = logits.float()
        if self.temperature != 1.0:
            z = z / self.temperature
        if self.banned_token_ids:
            index = torch.tensor(self.banned_token_ids, dtype=torch.long, device=z.device)
            index = index[index < z.shape[-1]]  # ids past the lm-head rows do not exist
            z = z.index_fill(-1, index, BANNED_LOGIT)
        return z


def truncation_warning(top_p: float, top_k: int) -> str | None:
    """A start-up warning when the engines truncate the distribution the actor scores (else None)."""
    if top_p >= 1.0 and top_k <= 0:
        return None
    return (
        f"worker.rollout.top_p={top_p} / top_k={top_k} truncate the sampling distribution; the actor "
        "scores the untruncated one (temperature and token ban only, see vlrl.models.sampling), so the "
        "importance ratio and rollout/log_prob_diff_* include the truncation"
    )
