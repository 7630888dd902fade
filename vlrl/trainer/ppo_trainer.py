"""The single controller: `PPOTrainer.fit()` runs the GRPO-family loop over the rank workers.

One step, top to bottom (see `train_step`):
  1. generate   n responses per prompt on every rank's rollout engine (its data-parallel shard)
  2. reward     decode and score the responses in the generating ranks' reward worker processes
     (online filtering: drop groups whose mean reward is at a bound, generate more, repeat)
  3. log-probs  old-policy and reference log-probs on the ranks (token-balanced shards)
  4. KL         penalty in the reward (unless it is a loss term)
  5. advantages from the token-level rewards and the groups
  6. update     the actor on the ranks, then push the weights to the engines

The trainer does not know about Ray: it is given its data, its reward runner and a function that
starts its ranks (`vlrl.trainer.ray_trainer.build_trainer` passes the Ray `RankGroup`; the unit
tests pass `InProcessRanks`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sized
from typing import Any

import torch

from vlrl.algorithms import (
    KLPenalty,
    PenalizedRewards,
    compute_advantages,
    make_kl_controller,
)
from vlrl.algorithms.importance import combine_drift
from vlrl.batch.held import publish, take
from vlrl.batch.image_refs import ImageRefs
from vlrl.batch.rows import PromptBatch, RolloutBatch, TokenRewards
from vlrl.batch.samples import StepSamples
from vlrl.config import PPOConfig
from vlrl.data.samplers import first_pass_note
from vlrl.models.sampling import truncation_warning
from vlrl.rollout.base import eos_token_ids
from vlrl.trainer.async_rollout import AsyncRollout
from vlrl.trainer.checkpoint import CheckpointManager, check_checkpoint, read_state
from vlrl.trainer.dispatch import (
    balanced_shards,
    gather_penalized,
    update_inputs,
)
from vlrl.trainer.loggers import Tracker, logged_history
from vlrl.trainer.metrics import (
    PhaseTimer,
    SignalWatch,
    batch_metrics,
    drift_warning,
    has_signal,
    throughput_metrics,
)
from vlrl.trainer.ranks import RankRoles
from vlrl.trainer.rounds import BatchFiller
from vlrl.trainer.sources import (
    EngineCalls,
    GreedyBaseline,
    PrefetchedRounds,
    RolloutSource,
    Round,
    SynchronousRounds,
)
from vlrl.trainer.validation import Validation
from vlrl.utils.busy_clock import BUSY_S, WALL_S, IdleShares
from vlrl.utils.checkpoint_files import CorruptCheckpoint, check_shared_filesystem
from vlrl.utils.phase_times import PhaseTimes
from vlrl.workers.rank_worker import RankWorker, check_same_banned_tokens
from vlrl.workers.scoring import BatchScorer

logger = logging.getLogger(__name__)


def _setup_phases(metrics: dict[str, float]) -> str:
    """A rank's `setup/<phase>_s` metrics (`RankWorker.setup`) as `phase 1.2 s, ...`."""
    phases = {k[len("setup/") : -len("_s")]: v for k, v in metrics.items() if k.startswith("setup/")}
    return ", ".join(f"{name} {s:.1f} s" for name, s in phases.items() if name != "total")


class PPOTrainer:
    """The loop. `data`: a `TrainingData`; `rewards`: a `RewardRunner` (anything with `score` and
    `close`); `start_ranks`: called once the driver-side checks passed, returns the (not yet set up)
    ranks."""

    def __init__(
        self,
        config: PPOConfig,
        data: Any,
        rewards: Any,
        start_ranks: Callable[[], RankRoles],
        image_refs: ImageRefs | None = None,
        checkpoints: CheckpointManager | None = None,
        startup: PhaseTimes | None = None,
    ) -> None:
        self.config = config
        self.image_refs = image_refs  # batches carry image references, not pixels (vlrl.batch.image_refs)
        self.data = data
        self.tokenizer = data.tokenizer
        self.scorer = BatchScorer(
            self.tokenizer, data.pad_token_id,
            eos_token_ids(self.tokenizer, config.worker.actor.model.model_path),  # the engines' (same files)
            config.worker.reward.skip_special_tokens,
        )  # fmt: skip
        self.rewards = rewards
        algo = config.algorithm
        self.kl_ctrl = make_kl_controller(algo.kl_type, algo.kl_coef, algo.kl_target, algo.kl_horizon)
        run_root = config.trainer.save_checkpoint_path
        assert run_root is not None  # PPOConfig.finalize() fills it in
        self.checkpoints = checkpoints or CheckpointManager(run_root, config.trainer.save_limit)
        self.run_dir = os.path.join(run_root, "logs")
        self.tracker = Tracker(config.trainer.logger, config.trainer.project_name, config.trainer.experiment_name,
                               self.run_dir, config.to_dict())  # fmt: skip
        self.global_step = 0
        self.total_steps = planned_steps(config, data.train_loader)
        _say_first_pass(config, len(data.train_loader.dataset), self.total_steps)
        self.checkpoints.check_no_collisions(self._save_steps())
        trainer_config = config.trainer
        self.validation = (
            Validation(
                data.val_loader, config.worker.rollout.val_override_config, trainer_config.val_blind_rows,
                trainer_config.val_generations_to_log,
                lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            )
            if data.val_loader is not None
            else None
        )  # fmt: skip
        self.history: list[dict[str, float]] = []  # per-step metrics, for the summary and the plot
        self.drift_steps = 0  # steps whose engine/actor log-prob gap exceeded log_prob_diff_warn
        self.signal = SignalWatch()  # steps in a row with all-zero advantages
        self.idle = IdleShares()  # each role's share of wall time waiting (vlrl.utils.busy_clock)
        warning = truncation_warning(config.worker.rollout.top_p, config.worker.rollout.top_k)
        if warning:
            logger.warning(warning)
        self.roles = start_ranks()
        self.ranks, self.engines = self.roles.train, self.roles.generate  # the same group unless async
        check_shared_filesystem(  # before the (long) model loading
            run_root,
            lambda *probe: self.ranks.call_all(RankWorker.probe_shared_path, *probe),
        )
        self.calls = EngineCalls(config, self.engines, rewards, self.scorer, data.pad_token_id, image_refs)
        startup = startup or PhaseTimes("startup")
        with startup.phase("models"):
            flow, rank_setup = self._setup_ranks()
        first = "the first rollout rank" if self.roles.separate else "rank 0"
        print(f"[vlrl] start-up {startup.brief()} ({first}'s models: {_setup_phases(rank_setup)})",
              file=sys.stderr, flush=True)  # fmt: skip

        def next_prompts() -> PromptBatch:
            return self.data.next_train_batch()  # through `self.data`, whatever it is by then

        self.source: RolloutSource = (
            SynchronousRounds(self.calls, next_prompts)
            if flow is None
            else PrefetchedRounds(self.calls, next_prompts, flow, self.total_steps, self.idle)
        )
        self.baseline = GreedyBaseline(self.calls) if config.plan.baseline == "greedy" else None
        self.filler = BatchFiller(
            config.data.rollout_batch_size, config.worker.rollout.n, algo, config.trainer.max_try_make_batch,
            data.pad_token_id,
        )  # fmt: skip

    def _setup_ranks(self) -> tuple[AsyncRollout | None, dict[str, float]]:
        """Load the models and engines (both roles at once in asynchronous mode, which then also
        forms the weight-broadcast group and checks both roles ban the same tokens). Returns the
        asynchronous flow (None when synchronous) and the first engine rank's setup metrics."""
        args = (
            self.data.max_images_per_prompt, self._optimizer_steps(), self.data.max_videos_per_prompt,
            self.calls.rank_scoring,
        )  # fmt: skip
        if not self.roles.separate:
            return None, self.ranks.call_all(RankWorker.setup, *args)[0]
        loading = [self.ranks.submit(RankWorker.setup, *([a] * len(self.ranks.workers) for a in args)),
                   self.engines.submit(RankWorker.setup, *([a] * len(self.engines.workers) for a in args))]  # fmt: skip
        engine_setup = [pending.result() for pending in loading][1][0]
        actor_banned = self.ranks.call_all(RankWorker.banned_token_ids)[0]
        for engine_banned in self.engines.call_all(RankWorker.banned_token_ids):
            check_same_banned_tokens(engine_banned, actor_banned)
        flow = AsyncRollout(self.roles, self.config.worker.rollout.max_staleness)
        flow.connect(lambda: self.ranks.call_all(RankWorker.free_address)[0])
        return flow, engine_setup

    def _save_steps(self) -> list[int]:
        """Steps this run saves a checkpoint at: every `save_freq`, and the last."""
        freq = self.config.trainer.save_freq
        steps = set(range(freq, self.total_steps + 1, freq)) if freq > 0 else set()
        return sorted(steps | {self.total_steps})

    def _optimizer_steps(self) -> int:
        """Actor optimizer steps of the whole run (for the LR schedule)."""
        return self.total_steps * self.config.optimizer_steps_per_step

    # ------------------------------------------------------------------------------ the loop
    def fit(self) -> list[dict[str, float]]:
        from tqdm import tqdm

        self._resume()
        trainer = self.config.trainer
        # The loaded model is validated first, resumed or not (as in EasyR1); val_only stops there.
        if (trainer.val_before_train or trainer.val_only) and self.data.val_loader is not None:
            self.tracker.log(self.validate(), step=self.global_step)
        if trainer.val_only:
            return []  # no step trained
        progress = tqdm(total=self.total_steps, initial=self.global_step, desc="steps", disable=None)
        while self.global_step < self.total_steps:
            self.global_step += 1
            metrics = self.train_step()
            last = self.global_step == self.total_steps
            val_score = None
            if self.data.val_loader is not None and (
                last or (trainer.val_freq > 0 and self.global_step % trainer.val_freq == 0)
            ):
                val_metrics = self.validate()
                metrics.update(val_metrics)
                val_score = val_metrics.get("val/overall")
            # Log before saving: a crash in between re-runs this step after resume (same values)
            # instead of leaving a checkpointed step that was never logged.
            self.history.append({"step": self.global_step, **metrics})
            self.tracker.log(metrics, step=self.global_step)
            if last or (trainer.save_freq > 0 and self.global_step % trainer.save_freq == 0):
                self.save_checkpoint(val_score)
            progress.update(1)
        progress.close()
        self.source.close()
        return self.history

    def train_step(self) -> dict[str, float]:
        timer, metrics = PhaseTimer(), {}
        with timer("step"):
            # 1-2. draw prompts, generate and score until the batch holds rollout_batch_size groups;
            # the rows stay on the generating ranks, the driver holds `StepSamples`
            batch, baselines, reward_metrics = self._generate_scored_batch(timer)
            metrics.update(reward_metrics)
            ulysses = self.config.worker.actor.ulysses_size
            shards = balanced_shards(batch.sequence_lengths, self.config.train_world_size, ulysses)
            with timer("old_ref"):  # 3-4.
                penalized = self._take_rows(batch, shards)
            with timer("adv"):  # 5.
                token_rewards = self._advantages(batch, penalized, baselines, metrics)
            # 6. actor update (advantages weighted by truncated IS there), then weight sync to the engines
            with timer("update"):
                results = self.ranks.call(RankWorker.update, update_inputs(batch, shards, token_rewards))
            metrics.update(_mean_over_ranks([m for m, _ in results]))
            clock = (metrics.pop(BUSY_S), metrics.pop(WALL_S))  # the training ranks' mean
            metrics.update(self.idle.metrics("train" if self.roles.separate else "hybrid", clock))
            metrics.update(combine_drift([drift for _, drift in results]))
        if self.image_refs is not None:
            self.image_refs.clear()  # the ranks' updates released theirs
        metrics.update(batch_metrics(batch, self.config.data.max_response_length))
        metrics.update(self.data.step_metrics(batch))
        metrics.update(self._check_drift(metrics))
        stalled = self.signal.update(has_signal(batch.advantages, metrics), metrics)
        if stalled is not None:
            logger.warning("step %d: %s", self.global_step, stalled)
        metrics["training/steps_without_signal"] = float(self.signal.in_a_row)
        metrics.update(timer.metrics())
        metrics.update(throughput_metrics(batch, timer.seconds["step"], self.config.world_size))
        metrics["training/epoch"] = float(self.data.epoch)
        return metrics

    def _take_rows(self, batch: StepSamples, shards: list[list[int]]) -> PenalizedRewards | None:
        """3. Each training rank takes its token-balanced shard of the rows and keeps it with the
        log-probs the step plan asks for (old ones, all or after its first mini-batch; reference). 4. With the KL
        penalty in the reward (GRPO puts KL in the loss instead) the ranks put it into their rows'
        rewards: their per-response values, in batch order."""
        algo, plan = self.config.algorithm, self.config.plan
        kl_in_reward = plan.kl == "reward"
        scores = batch.tensor("token_level_scores").sum(-1)  # [N] each response's score
        penalties = [
            KLPenalty(self.kl_ctrl.value, algo.kl_penalty, scores[rows], algo.low_var_kl_clamp)
            if kl_in_reward
            else None
            for rows in shards
        ]
        plans = [batch.plan(rows) for rows in shards]
        results = self.ranks.call(RankWorker.take_rows, plans, shards, penalties)
        return gather_penalized(shards, results, len(batch)) if kl_in_reward else None

    def _advantages(
        self,
        batch: StepSamples,
        penalized: PenalizedRewards | None,
        baselines: torch.Tensor | None,
        metrics: dict[str, float],
    ) -> TokenRewards | None:
        """5. An outcome estimator's advantages, here; a token-level estimator's are computed by the
        ranks that hold the tokens: what they need is returned. The KL penalty's controller moves."""
        algo = self.config.algorithm
        scores = batch.tensor("token_level_scores").sum(-1)  # [N]
        kl_coef = None
        if penalized is not None:
            kl_coef, current_kl = self.kl_ctrl.value, penalized.current_kl()  # the coefficient the ranks used
            self.kl_ctrl.update(current_kl, n_steps=len(batch))
            metrics.update({"critic/kl": current_kl, "critic/kl_coef": self.kl_ctrl.value})
        batch.sequence_rewards = scores if penalized is None else penalized.sums
        if self.config.plan.advantages == "ranks":
            return TokenRewards(
                algo.adv_estimator, scores, algo.gamma, kl_coef, algo.kl_penalty, algo.low_var_kl_clamp
            )
        batch.advantages = self._outcome_advantages(batch, penalized, baselines)
        return None

    def _outcome_advantages(
        self, batch: StepSamples, penalized: PenalizedRewards | None, baselines: torch.Tensor | None
    ) -> torch.Tensor:
        """[N, R] advantages of an outcome estimator from the scores, or from the per-response
        scores with the KL penalty in them that the ranks computed."""
        algo, mask = self.config.algorithm, batch.response_mask
        kwargs = dict(gamma=algo.gamma, norm_by_std=algo.norm_adv_by_std_in_grpo, baseline_scores=baselines)
        if penalized is None:
            scores = batch.tensor("token_level_scores")
            return compute_advantages(algo.adv_estimator, scores, mask, batch.group_ids, **kwargs)[0]
        # the estimator reduces each response to one score: the ranks sent it [N]
        per_response, ones = penalized.sequence_scores[:, None], torch.ones(len(batch), 1)
        advantages = compute_advantages(algo.adv_estimator, per_response, ones, batch.group_ids, **kwargs)[0]
        return advantages * mask.to(advantages.dtype)  # [N, 1] -> [N, R], as the estimators spread it

    def _check_drift(self, metrics: dict[str, float]) -> dict[str, float]:
        """Warn when the engine's log-probs and the actor's disagree (see log_prob_diff_warn)."""
        if "rollout/log_prob_diff_mean" not in metrics:
            return {}
        warning = drift_warning(metrics, self.config.worker.rollout.log_prob_diff_warn)
        if warning is not None:
            self.drift_steps += 1
            logger.warning("step %d: %s", self.global_step, warning)
        return {"rollout/log_prob_drift_steps": float(self.drift_steps)}

    # ------------------------------------------------------------------------ generation
    def _generate_scored_batch(
        self, timer: PhaseTimer
    ) -> tuple[StepSamples, torch.Tensor | None, dict[str, float]]:
        """Generation rounds from the rollout source until the batch holds `rollout_batch_size`
        groups (`BatchFiller`): the batch, the ReMax baselines [N] (None for other estimators) and
        the metrics. Each round's groups go into the prompts' statistics."""
        step, baseline = self.global_step, self.baseline

        def draw(round_: int) -> Round:
            prompts, batch, metrics = self.source.round(round_, step, timer)
            self.data.record(batch, step)
            return prompts, batch, metrics

        def baselines(prompts: PromptBatch, batch: StepSamples, round_: int) -> torch.Tensor:
            assert baseline is not None
            return baseline.baselines(prompts, batch, round_, step)

        return self.filler.fill(draw, baselines if baseline is not None else None)

    # ------------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        self.source.before_validation(self.global_step)

        def generate(prompts: PromptBatch, overrides: dict[str, Any], with_ids: bool) -> StepSamples:
            return self.calls.generate_scored(
                prompts, self.global_step, overrides=overrides, keep=False, responses_back=with_ids
            )[0]

        assert self.validation is not None  # the loop validates only when there is val data
        metrics, samples = self.validation.run(generate, self.global_step)
        if self.image_refs is not None:
            self.image_refs.clear()
            self.engines.call_all(RankWorker.release_images)
        if samples:
            self.tracker.log_generations(samples, self.global_step)
        return metrics

    # ------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, val_score: float | None) -> str:
        model_only = self.config.trainer.save_model_only

        def write_actor(folder: str) -> None:
            self.ranks.call_all(RankWorker.save_checkpoint, folder, model_only)
            self.data.stats.save(os.path.dirname(folder))
            self.source.save(os.path.dirname(folder), self._fetch_media, self._rows_of)

        state = {
            "dataloader": self.data.state_dict(),
            "kl_coef": self.kl_ctrl.value,
            "model_only": model_only,
        }
        return self.checkpoints.save(self.global_step, write_actor, state, val_score, self._digest)

    def _digest(self, folder: str) -> dict[str, dict[str, Any]]:
        """The checksums of a checkpoint's files, hashed by the ranks between them."""
        return {
            k: v
            for part in self.ranks.call_all(RankWorker.digest_checkpoint_files, folder)
            for k, v in part.items()
        }

    def _verify(self, folder: str, files: dict[str, dict[str, Any]]) -> list[str]:
        return [
            p for part in self.ranks.call_all(RankWorker.verify_checkpoint_files, folder, files) for p in part
        ]

    def _resume(self) -> None:
        trainer = self.config.trainer
        path = trainer.load_checkpoint_path
        if path is not None:
            problems = check_checkpoint(path, self._verify)
            if problems:
                raise CorruptCheckpoint(f"trainer.load_checkpoint_path={path} cannot be resumed from: "
                                        + "; ".join(problems[:5]))  # fmt: skip
        elif trainer.find_last_checkpoint:
            path = self.checkpoints.resume_point(self._verify)
        if path is None:
            return
        state = read_state(path)
        if state.get("model_only"):
            raise ValueError(
                f"{path} was saved with trainer.save_model_only=true: it holds weights only and cannot be "
                "resumed; start a new run from its actor/huggingface folder (worker.actor.model.model_path)"
            )
        self.ranks.call_all(RankWorker.load_checkpoint, os.path.join(path, "actor"))
        self.source.load(path, self._publish)
        self.data.load_state_dict(state["dataloader"])
        if not self.data.stats.load(path):
            logger.warning("%s holds no prompt statistics (saved by an older vlrl): they start anew", path)
        self.kl_ctrl.value = state.get("kl_coef", self.kl_ctrl.value)
        self.global_step = state["global_step"]
        self.history = logged_history(self.run_dir, self.global_step)  # the summary covers the whole run
        print(f"[vlrl] resumed from {path} at step {self.global_step}", flush=True)

    def _fetch_media(self, images: list[list[Any]]) -> list[list[Any]]:
        """The images or videos behind references (to write them into a checkpoint)."""
        return images if self.image_refs is None else self.image_refs.resolve(images)

    def _rows_of(self, samples: StepSamples) -> RolloutBatch:
        """All the rows of `samples`, fetched from where they are held (to write them into a checkpoint)."""
        return take(samples.plan(list(range(len(samples)))), self.data.pad_token_id)

    def _publish(self, batch: RolloutBatch) -> StepSamples:
        """Rows read from a checkpoint, published by the driver (images as references) for the ranks."""
        if self.image_refs is not None:
            self.image_refs.refer(batch)
        return StepSamples.of(batch, publish(batch))

    def close(self) -> None:
        self.tracker.close()
        self.rewards.close()
        self.roles.shutdown()
        self.checkpoints.close()


def planned_steps(config: PPOConfig, train_loader: Sized) -> int:
    """Steps of the run: `trainer.max_steps` when set (epochs then repeat as needed, as in EasyR1),
    else batches of `rollout_batch_size` prompts per epoch x `total_epochs`; the training loader
    has a batch of `mini_rollout_batch_size` prompts when that is set."""
    data, trainer = config.data, config.trainer
    if trainer.max_steps is not None:
        return trainer.max_steps
    per_batch = data.mini_rollout_batch_size or data.rollout_batch_size
    return len(train_loader) * per_batch // data.rollout_batch_size * trainer.total_epochs


def _say_first_pass(config: PPOConfig, prompts: int, steps: int) -> None:
    """Where the pass-rate sampler's own choices start (with mixing or a curriculum each entry or pool
    has its own first pass, so nothing is said)."""
    data = config.data
    if data.sampler == "pass_rate" and data.train_weights is None and data.curriculum is None:
        note = first_pass_note(prompts, data.rollout_batch_size, steps, config.algorithm.online_filtering)
        print(f"[vlrl] {note}", file=sys.stderr, flush=True)


def _mean_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the ranks; a non-finite value stays so (logged as nan/inf, never dropped)."""
    return {k: sum(m[k] for m in per_rank) / len(per_rank) for k in per_rank[0]}
