"""`PromptStats`: what each training prompt's groups scored so far, kept by the driver.

Every generated group (every round, before online filtering) is recorded: its samples count as
attempts, their `overall` rewards add to the reward sum, and their *pass* values add to the pass sum.
A sample's pass value is its `accuracy` reward part when the reward function returns one, else its
`overall` reward. Arrays are indexed by dataset index (the loader's numbering); a batch names its
prompts by uid (`PromptSample.uid`), mapped here with a sorted copy of the uids.

For the pass-rate sampler each prompt also has a belief about its pass rate *now*, which follows the
policy as it learns: a scalar `level` (logit of the pass rate of a prompt never seen: the policy's
level on an average prompt), and per prompt an `offset` (logit of its pass rate minus the level) and
an `evidence` weight (samples' worth; each new group weighs as much as all earlier ones together). A
prompt scored 4 of 8 when the level was -1 is expected to pass more often once the level is +2: its
belief moves with the level (a one-parameter item-response model: pass rate = sigmoid(level +
offset)), so the sampler does not keep redrawing prompts the policy has long solved. Each round
moves the level by one Fisher-scoring step of that model's likelihood over the round's groups.

Memory: 45 bytes per prompt (45 MB at a million prompts). Saved in each checkpoint as
`prompt_stats.pt` and loaded on resume, so the statistics (and the pass-rate sampler that reads
them) continue exactly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

FILE = "prompt_stats.pt"
HIST_BINS = 10  # bins of the logged pass-rate histogram
PRIOR_WEIGHT = 2.0  # samples' worth of evidence in a prompt's prior (at the level)
MAX_LEVEL_STEP = 1.0  # logits the level may move in one round (a round of all passes has no MLE)


def hist_key(bin_: int) -> str:
    """The metric key of pass-rate histogram bin `bin_` (0 .. HIST_BINS - 1)."""
    return f"prompts/pass_rate_hist/{bin_ / HIST_BINS:.1f}"


_FIELDS = ("attempts", "reward_sum", "pass_sum", "offset", "evidence", "level", "last_step", "pending")


class PromptStats:
    """Per-prompt attempts, reward sum, pass sum and last step recorded (-1: never). The pass-rate
    sampler reads `belief` (from `level`, `offset`, `evidence`: see the module docstring) and
    `pending` (handed out in a batch whose scores have not come back yet: async prefetch, later
    rounds)."""

    def __init__(self, uids: Sequence[int]) -> None:
        self.uids = torch.as_tensor(list(uids), dtype=torch.long)  # [N] uid of each dataset index
        self._sorted_uids, self._index_of_sorted = torch.sort(self.uids)
        n = len(self.uids)
        self.attempts = torch.zeros(n, dtype=torch.int32)
        self.reward_sum = torch.zeros(n, dtype=torch.float64)
        self.pass_sum = torch.zeros(n, dtype=torch.float64)
        self.offset = torch.zeros(n, dtype=torch.float32)  # logit pass rate - level; 0: never seen
        self.evidence = torch.zeros(n, dtype=torch.float32)
        self.level = torch.zeros((), dtype=torch.float64)
        self.last_step = torch.full((n,), -1, dtype=torch.int32)
        self.pending = torch.zeros(n, dtype=torch.bool)

    def __len__(self) -> int:
        return len(self.uids)

    def indices(self, uids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Dataset indices of `uids` [M]; a KeyError naming a uid this dataset does not hold."""
        wanted = torch.as_tensor(uids, dtype=torch.long)
        where = torch.searchsorted(self._sorted_uids, wanted).clamp(max=max(len(self) - 1, 0))
        missing = (
            self._sorted_uids[where] != wanted if len(self) else torch.ones_like(wanted, dtype=torch.bool)
        )
        if bool(missing.any()):
            raise KeyError(f"prompt uid {int(wanted[missing][0])} is not a row of the training data")
        return self._index_of_sorted[where]

    def mark_pending(self, uids: Sequence[int]) -> None:
        self.pending[self.indices(uids)] = True

    def record(self, uids: Sequence[int], parts: Sequence[dict[str, float]], step: int) -> None:
        """Record one round's samples: `uids[i]` is sample i's prompt, `parts[i]` its reward parts."""
        if not uids:
            return
        rows = self.indices(uids)
        overall = torch.tensor([float(p["overall"]) for p in parts], dtype=torch.float64)
        passes = torch.tensor([float(p.get("accuracy", p["overall"])) for p in parts], dtype=torch.float64)
        prompts, slot = torch.unique(rows, return_inverse=True)  # each prompt once, in slots [P]
        group_pass = torch.zeros(len(prompts), dtype=torch.float64).index_add_(0, slot, passes)
        group_size = torch.zeros(len(prompts), dtype=torch.float64).index_add_(
            0, slot, torch.ones_like(passes)
        )
        self.attempts.index_add_(0, rows, torch.ones(len(rows), dtype=torch.int32))
        self.reward_sum.index_add_(0, rows, overall)
        self.pass_sum.index_add_(0, rows, passes)
        self._update_beliefs(prompts, group_pass, group_size)
        self.last_step[prompts] = step
        self.pending[prompts] = False

    def belief(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's pass rate now as a Beta distribution: its mean and concentration. [R] float64"""
        mean = torch.sigmoid(self.level + self.offset[rows].double())
        return mean, self.evidence[rows].double() + PRIOR_WEIGHT

    def _update_beliefs(self, prompts: torch.Tensor, passes: torch.Tensor, size: torch.Tensor) -> None:
        """One round's groups ([P] prompts, their passes and samples): first the level, by one
        Fisher-scoring step of the model's log-likelihood over the groups (score / information at
        the level before the round, capped at MAX_LEVEL_STEP); then each prompt's belief at the new
        level, its earlier evidence halved, updated by its group as a Beta prior."""
        # pass values outside [0, 1] (a reward without `accuracy` whose `overall` is, say, -1: the
        # sampler refuses them, the shuffle records them) must not make a belief NaN
        passes = torch.minimum(passes.clamp(min=0.0), size)
        expected = torch.sigmoid(self.level + self.offset[prompts].double())  # [P]
        information = float((size * expected * (1 - expected)).sum())
        score = float((passes - size * expected).sum())
        move = max(-MAX_LEVEL_STEP, min(MAX_LEVEL_STEP, score / max(information, 1e-9)))
        self.level = self.level + move
        prior, prior_weight = self.belief(prompts)
        prior_weight = prior_weight - self.evidence[prompts].double() / 2  # earlier evidence halved
        posterior = (prior * prior_weight + passes) / (prior_weight + size)  # in (0, 1): prior_weight >= 2
        self.offset[prompts] = (torch.logit(posterior) - self.level).float()
        self.evidence[prompts] = (self.evidence[prompts].double() / 2 + size).float()

    def pass_values_in_unit_range(self, parts: Sequence[dict[str, float]]) -> str | None:
        """Why these samples' pass values cannot be pass rates (outside [0, 1]), or None."""
        for p in parts:
            value = float(p.get("accuracy", p["overall"]))
            if not 0.0 <= value <= 1.0:
                name = "accuracy" if "accuracy" in p else "overall"
                return f"a sample's {name!r} reward is {value:g}, outside [0, 1]"
        return None

    def metrics(self) -> dict[str, float]:
        """`prompts/seen_share`: prompts attempted at least once; over them, `prompts/pass_rate_mean`
        and the histogram of their pass rates, `prompts/pass_rate_hist/<lo>` = the share in
        [lo, lo + 0.1) (the last bin holds 1.0); `prompts/level_pass_rate`: sigmoid(level), what the
        sampler expects of a prompt never seen."""
        seen = self.attempts > 0
        out = {"prompts/seen_share": int(seen.sum()) / max(len(self), 1)}
        if bool(seen.any()):
            out["prompts/level_pass_rate"] = float(torch.sigmoid(self.level))  # a prompt never seen
            rates = self.pass_sum[seen] / self.attempts[seen]  # [seen]
            out["prompts/pass_rate_mean"] = float(rates.mean())
            bins = (rates * HIST_BINS).long().clamp(0, HIST_BINS - 1)
            counts = torch.bincount(bins, minlength=HIST_BINS).tolist()
            out.update({hist_key(b): c / len(rates) for b, c in enumerate(counts)})
        return out

    # ---- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"uids": self.uids, **{name: getattr(self, name) for name in _FIELDS}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not torch.equal(state["uids"], self.uids):
            raise ValueError(
                "the checkpoint's prompt statistics are of other training data (their prompt uids differ); "
                "resume with the data the run was started with"
            )
        if "offset" not in state:  # saved before the level (2026-12-06): start the beliefs afresh
            logging.getLogger(__name__).warning(
                "the checkpoint's prompt statistics predate the pass-rate sampler's level model: their "
                "counts carry over, the sampler's beliefs start afresh from the next groups scored"
            )
            state = {**state, **_fresh_beliefs(len(self.uids))}
        for name in _FIELDS:
            setattr(self, name, state[name].clone())

    def save(self, folder: str) -> None:
        torch.save(self.state_dict(), os.path.join(folder, FILE))

    def load(self, folder: str) -> bool:
        """Load `folder`'s statistics; False when the checkpoint has none (saved by an older vlrl)."""
        path = os.path.join(folder, FILE)
        if not os.path.isfile(path):
            return False
        self.load_state_dict(torch.load(path, weights_only=True))
        return True


def _fresh_beliefs(n: int) -> dict[str, torch.Tensor]:
    """Beliefs of prompts never seen, for statistics saved before the beliefs existed (their counts
    carry over; the sampler's beliefs are rebuilt from the groups recorded after the resume)."""
    return {
        "offset": torch.zeros(n, dtype=torch.float32),
        "evidence": torch.zeros(n, dtype=torch.float32),
        "level": torch.zeros((), dtype=torch.float64),
    }
