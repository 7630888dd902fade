"""The step plan: which passes a training step runs and where each quantity is computed, derived
once from what the chosen advantage estimator, KL placement and off-policy correction declare they
need (`ESTIMATOR_NEEDS`, `CORRECTION_NEEDS`).

The plan is the one place that decides which log-probs exist in a step: the trainer, the rank
workers and the actor read it (`PPOConfig.plan`) instead of combining config keys themselves. A new
estimator or correction declares its needs here and every reader follows.

A step, in the plan's words (docs/architecture.md draws it):
    fill (generation rounds; `baseline=greedy`: a greedy response per prompt too)
    take (each rank's rows; `old_log_probs=pass`: the old policy's log-probs, `mixed`: those of the
          rows after the rank's first mini-batch; `reference`: the reference policy's; `kl=reward`:
          the KL penalty put into the rewards)
    advantages (`advantages=driver`: the outcome estimator on the driver; `ranks`: token-level,
          on the ranks that hold the tokens)
    update (the `correction` preset applied to the advantages; the PPO ratio against `ratio_from`;
          `update` / `mixed`: the first mini-batch's forward, on the weights that generated the
          rows, gives its old log-probs: detached, ratio 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from vlrl.config import PPOConfig


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an advantage estimator needs from the step."""

    groups: bool = False  # compares the samples of one prompt (worker.rollout.n > 1)
    token_level: bool = False  # advantages vary along the response: computed where the tokens are
    greedy_baseline: bool = False  # a greedy response per prompt, scored, is each sample's baseline


# one entry per name in vlrl.algorithms.advantages.ADV_ESTIMATORS (tests/algorithms/test_plan.py)
ESTIMATOR_NEEDS: dict[str, EstimatorNeeds] = {
    "grpo": EstimatorNeeds(groups=True),
    "dr_grpo": EstimatorNeeds(groups=True),
    "rloo": EstimatorNeeds(groups=True),
    "grpo_passk": EstimatorNeeds(groups=True),
    "reinforce_plus_plus": EstimatorNeeds(token_level=True),
    "remax": EstimatorNeeds(greedy_baseline=True),
}


@dataclass(frozen=True)
class CorrectionNeeds:
    """What an off-policy correction of the advantages needs."""

    engine_log_probs: bool  # the behaviour policy's log-prob of each sampled token
    old_pass: bool  # the actor's old log-probs before the update (the update cannot make them)


# `algorithm.off_policy_correction` presets (their weights: vlrl.algorithms.importance): each divides
# the actor's old log-prob by the engine's, so each needs both before the update
CORRECTION_NEEDS: dict[str, CorrectionNeeds] = {
    name: CorrectionNeeds(engine_log_probs=True, old_pass=True)
    for name in ("token_tis", "seq_tis", "token_mask", "seq_mask")
}

OldLogProbs = Literal["pass", "update", "mixed"]
KLPlacement = Literal["none", "reward", "loss"]


@dataclass(frozen=True)
class StepPlan:
    """What one training step computes (see the module docstring for the step it describes)."""

    # pass: an old-policy pass over the rows; update: the update's own (each rank's rows are one
    # mini-batch); mixed: the update's own for each rank's first mini-batch, a pass for the rest
    old_log_probs: OldLogProbs
    ratio_from: Literal["actor", "rollout"]  # whose log-probs the PPO ratio divides by
    reference: bool  # reference log-probs are computed (a reference model is built)
    kl: KLPlacement  # where the KL to the reference goes
    advantages: Literal["driver", "ranks"]  # driver: outcome estimators; ranks: token-level ones
    baseline: Literal["group", "greedy"]  # greedy: ReMax's extra greedy generation round
    correction: str  # "none", or the CORRECTION_NEEDS preset that weights the advantages
    engine_log_probs: bool  # the engines return each sampled token's log-prob

    def describe(self) -> str:
        """One line for the start-up log."""
        return (
            f"old log-probs: {self.old_log_probs}; ratio from: {self.ratio_from}; reference: "
            f"{'yes' if self.reference else 'no'}; KL: {self.kl}; advantages on: {self.advantages}; "
            f"baseline: {self.baseline}; correction: {self.correction}; engine log-probs: "
            f"{'yes' if self.engine_log_probs else 'no'}"
        )

    def problems(self) -> list[str]:
        """What this plan needs that it does not have (each a config error; empty when it holds)."""
        errors = []
        needs = CORRECTION_NEEDS.get(self.correction)
        if needs is not None and needs.engine_log_probs and not self.engine_log_probs:
            errors.append(
                f"algorithm.off_policy_correction={self.correction} (or tis_cap) divides by the engine's "
                "log-probs: set worker.rollout.calculate_log_probs=true"
            )
        if self.ratio_from == "rollout" and not self.engine_log_probs:
            errors.append(
                "algorithm.old_policy=rollout measures the ratio from the engine's log-probs: set "
                "worker.rollout.calculate_log_probs=true"
            )
        return errors


def step_plan(config: PPOConfig) -> StepPlan:
    """The plan of a derived config (`PPOConfig.derive` has resolved `old_policy=auto`)."""
    algo, rollout = config.algorithm, config.worker.rollout
    if algo.adv_estimator not in ESTIMATOR_NEEDS:
        raise ValueError(
            f"unknown advantage estimator {algo.adv_estimator!r}; valid: {sorted(ESTIMATOR_NEEDS)}"
        )
    estimator = ESTIMATOR_NEEDS[algo.adv_estimator]
    kl: KLPlacement = "none" if algo.disable_kl else "loss" if algo.use_kl_loss else "reward"
    correction = algo.off_policy_correction or "none"
    ratio_from: Literal["actor", "rollout"] = "rollout" if algo.old_policy == "rollout" else "actor"
    return StepPlan(
        old_log_probs=_old_log_probs(config, kl, correction),
        ratio_from=ratio_from,
        reference=kl != "none",
        kl=kl,
        advantages="ranks" if estimator.token_level else "driver",
        baseline="greedy" if estimator.greedy_baseline else "group",
        correction=correction,
        engine_log_probs=bool(rollout.calculate_log_probs),
    )


def _old_log_probs(config: PPOConfig, kl: KLPlacement, correction: str) -> OldLogProbs:
    """Where the old policy's log-probs come from. The update's first optimizer step runs on the
    weights that generated the rows, so the first mini-batch's forward gives its old log-probs
    (detached): `update` when each rank's rows are one mini-batch (global_batch_size >=
    rollout_batch_size; later epochs reuse them), `mixed` when there are more (a pass computes the
    rest before the first step moves the weights). `pass` (every row, before the advantages) when
    something needs them earlier: a KL penalty in the reward, a correction that declares `old_pass`,
    or asynchronous mode (the engines lag the actor: the first mini-batch was not generated by the
    weights it starts from). `mixed` became the default for several mini-batches in place of `pass`:
    the same old log-probs up to the forward's summation order, one pass over 1/mini-batches fewer
    rows."""
    needs_pass = (
        kl == "reward"
        or (correction in CORRECTION_NEEDS and CORRECTION_NEEDS[correction].old_pass)
        or config.worker.rollout.async_ranks > 0
    )
    if needs_pass:
        return "pass"
    if config.worker.actor.global_batch_size >= config.data.rollout_batch_size:
        return "update"
    # a ratio from the engine's log-probs reads no old ones; the pass serves the drift metric
    return "pass" if config.algorithm.old_policy == "rollout" else "mixed"
