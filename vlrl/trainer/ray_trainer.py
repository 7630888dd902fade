"""The single controller: `RayPPOTrainer.fit()` runs the GRPO-family loop over the rank workers.

One step, top to bottom (see `train_step`):
  1. generate   n responses per prompt on every rank's rollout engine (its data-parallel shard)
  2. reward     decode and score the responses in the reward worker processes
     (online filtering: drop groups whose mean reward is at a bound, generate more, repeat)
  3. log-probs  old-policy and reference log-probs on the ranks (token-balanced shards)
  4. KL         penalty in the reward (unless it is a loss term)
  5. advantages from the token-level rewards and the groups
  6. update     the actor on the ranks, then push the weights to the engines
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import torch

from vlrl.algorithms import apply_kl_penalty, compute_advantages, filter_groups, make_kl_controller
from vlrl.config import PPOConfig
from vlrl.models.sampling import truncation_warning
from vlrl.protocol import PromptBatch, RolloutBatch
from vlrl.rewards import RewardRunner, build_reward_inputs, scores_to_token_level
from vlrl.trainer.checkpoint import CheckpointManager, check_shared_filesystem, read_state
from vlrl.trainer.data_setup import TrainingData
from vlrl.trainer.dispatch import balanced_shards, gather_rows, merge_rollouts, split_prompts
from vlrl.trainer.loggers import Tracker
from vlrl.trainer.metrics import (
    PhaseTimer,
    batch_metrics,
    drift_warning,
    mean_reward_parts,
    multi_turn_metrics,
    throughput_metrics,
)
from vlrl.trainer.ray_workers import RankGroup, start_ray

logger = logging.getLogger(__name__)


class RayPPOTrainer:
    def __init__(self, config: PPOConfig) -> None:
        self.config = config
        self.data = TrainingData(config)
        self.tokenizer = self.data.tokenizer
        self.rewards = RewardRunner(config.worker.reward)  # a bad reward file fails here, at start-up
        algo = config.algorithm
        self.kl_ctrl = make_kl_controller(algo.kl_type, algo.kl_coef, algo.kl_target, algo.kl_horizon)
        run_root = config.trainer.save_checkpoint_path
        assert run_root is not None  # PPOConfig.finalize() fills it in
        self.checkpoints = CheckpointManager(run_root, config.trainer.save_limit)
        self.run_dir = os.path.join(run_root, "logs")
        self.tracker = Tracker(config.trainer.logger, config.trainer.project_name, config.trainer.experiment_name,
                               self.run_dir, config.to_dict())  # fmt: skip
        self.global_step = 0
        self.total_steps = self._total_steps()
        self.checkpoints.check_no_collisions(self._save_steps())
        self.history: list[dict[str, float]] = []  # per-step metrics, for the summary and the plot
        self.drift_steps = 0  # steps whose engine/actor log-prob gap exceeded log_prob_diff_warn
        warning = truncation_warning(config.worker.rollout.top_p, config.worker.rollout.top_k)
        if warning:
            logger.warning(warning)
        start_ray(config)
        self.ranks = RankGroup(config)
        check_shared_filesystem(  # before the (long) model loading
            run_root,
            lambda *probe: self.ranks.call_all("probe_shared_path", *probe),
        )
        self.ranks.call_all(
            "setup", self.data.max_images_per_prompt, self._optimizer_steps(), self.data.max_videos_per_prompt
        )

    def _total_steps(self) -> int:
        """`trainer.max_steps` when set (epochs then repeat as needed, as in EasyR1), else batches
        of `rollout_batch_size` prompts per epoch x `total_epochs` (the loader's batches are
        `mini_rollout_batch_size` prompts when that is set)."""
        data, trainer = self.config.data, self.config.trainer
        if trainer.max_steps is not None:
            return trainer.max_steps
        per_batch = data.mini_rollout_batch_size or data.rollout_batch_size
        return len(self.data.train_loader) * per_batch // data.rollout_batch_size * trainer.total_epochs

    def _save_steps(self) -> list[int]:
        """Steps this run saves a checkpoint at: every `save_freq`, and the last."""
        freq = self.config.trainer.save_freq
        steps = set(range(freq, self.total_steps + 1, freq)) if freq > 0 else set()
        return sorted(steps | {self.total_steps})

    def _optimizer_steps(self) -> int:
        """Actor optimizer steps of the whole run: steps x mini-batches per step x PPO epochs."""
        actor = self.config.worker.actor
        return (
            self.total_steps
            * (self.config.data.rollout_batch_size // actor.global_batch_size)
            * actor.ppo_epochs
        )

    # ------------------------------------------------------------------------------ the loop
    def fit(self) -> list[dict[str, float]]:
        from tqdm import tqdm

        self._resume()
        trainer = self.config.trainer
        if (
            (trainer.val_before_train or trainer.val_only)
            and self.data.val_loader is not None
            and self.global_step == 0
        ):
            self.tracker.log(self.validate(), step=0)
            if trainer.val_only:
                return self.history
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
        return self.history

    def train_step(self) -> dict[str, float]:
        algo, world = self.config.algorithm, self.config.world_size
        timer, metrics = PhaseTimer(), {}
        with timer("step"):
            # 1-2. draw prompts, generate and score until the batch holds rollout_batch_size groups
            batch, baselines, reward_metrics = self._generate_scored_batch(timer)
            metrics.update(reward_metrics)
            # 3. old and reference log-probs, on token-balanced shards
            # (on-policy: no old pass, the update's own log-probs are the old ones; only the reference)
            n, on_policy = len(batch), self.config.on_policy_update
            if not on_policy or self.config.use_reference:
                with timer("old_ref"):
                    shards = balanced_shards(batch, world, self.config.worker.actor.ulysses_size)
                    shard_batches = [batch.select(i) for i in shards]
                    results = self.ranks.call("compute_log_probs", shard_batches, with_old=not on_policy)
                    if not on_policy:
                        batch.old_log_probs = gather_rows(shards, [old for old, _ in results], n)
                    if results[0][1] is not None:
                        batch.ref_log_probs = gather_rows(shards, [ref for _, ref in results], n)
            # 4. KL penalty in the reward (GRPO instead puts KL in the loss: algorithm.use_kl_loss)
            with timer("adv"):
                batch.token_level_rewards = batch.tensor("token_level_scores")
                if batch.ref_log_probs is not None and not algo.use_kl_loss:
                    batch.token_level_rewards, current_kl = apply_kl_penalty(
                        batch.tensor("token_level_scores"), batch.tensor("old_log_probs"), batch.ref_log_probs,
                        batch.response_mask, self.kl_ctrl.value, algo.kl_penalty,
                    )  # fmt: skip
                    self.kl_ctrl.update(current_kl, n_steps=len(batch))
                    metrics.update({"critic/kl": current_kl, "critic/kl_coef": self.kl_ctrl.value})
                # 5. advantages
                batch.advantages, batch.returns = compute_advantages(
                    algo.adv_estimator, batch.token_level_rewards, batch.response_mask, batch.group_ids,
                    gamma=algo.gamma, lam=algo.lam, norm_by_std=algo.norm_adv_by_std_in_grpo,
                    baseline_scores=baselines,
                )  # fmt: skip
            # 6. actor update, then weight sync to the engines
            with timer("update"):
                shards = balanced_shards(batch, world, self.config.worker.actor.ulysses_size)
                results = self.ranks.call("update", [batch.select(i) for i in shards])
                if on_policy:  # the update computed them (for the rollout/log_prob_diff metrics)
                    batch.old_log_probs = gather_rows(shards, [old for _, old in results], n)
            metrics.update(_mean_over_ranks([m for m, _ in results]))
        metrics.update(batch_metrics(batch, self.config.data.max_response_length))
        metrics.update(self._check_drift(metrics))
        metrics.update(timer.metrics())
        metrics.update(throughput_metrics(batch, timer.seconds["step"], world))
        metrics["training/epoch"] = float(self.data.epoch)
        return metrics

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
    def _generate(
        self, prompts: PromptBatch, overrides: dict[str, Any] | None = None, round_: int = 0
    ) -> RolloutBatch:
        """Responses for `prompts` from every rank's engine. `round_`: the generation round of this
        step (each round gets its own seed)."""
        rollout = self.config.worker.rollout
        seed = _step_seed(rollout.seed, self.global_step) + round_ * 1_000_003
        overrides = {"seed": seed, **(overrides or {})}
        shards = split_prompts(prompts, self.config.world_size, rollout.tensor_parallel_size)
        results = self.ranks.call("generate", shards, overrides=overrides)
        return merge_rollouts(results, rollout.tensor_parallel_size, self.data.pad_token_id)

    def _generate_scored_batch(
        self, timer: PhaseTimer
    ) -> tuple[RolloutBatch, torch.Tensor | None, dict[str, float]]:
        """Draw loader batches (of `mini_rollout_batch_size` prompts when set), generate and score
        them, and (online filtering) drop groups at a reward bound, until `rollout_batch_size`
        groups are kept; the excess is cut off. Returns the batch, the ReMax baselines [N] (None
        for other estimators) and the metrics."""
        algo, trainer = self.config.algorithm, self.config.trainer
        kept: list[RolloutBatch] = []
        baselines: list[torch.Tensor] = []
        n_groups, tries, metrics = 0, 0, {}
        target = self.config.data.rollout_batch_size
        while True:
            tries += 1
            prompts = self.data.next_train_batch()
            with timer("gen"):
                batch = self._generate(prompts, round_=tries - 1)
            with timer("reward"):
                reward_metrics = self._score(batch)
            if not kept:
                metrics.update(reward_metrics)  # rewards before filtering: what the policy does
            keep = torch.ones(len(batch), dtype=torch.bool)
            if algo.online_filtering:
                keep = filter_groups(
                    self._filter_values(batch), batch.group_ids, algo.filter_low, algo.filter_high
                )
                metrics["filter/kept_ratio"] = keep.float().mean().item()
            if algo.adv_estimator == "remax":
                baselines.append(self._remax_baselines(prompts, batch, tries - 1)[keep])
            # group ids are unique within a round; rounds may repeat a prompt (a new epoch)
            batch.group_ids = batch.group_ids + ((tries - 1) << 40)
            kept.append(batch.select(keep) if not bool(keep.all()) else batch)
            n_groups += len(set(batch.group_ids[keep].tolist()))
            if n_groups >= target:
                break
            if 0 <= trainer.max_try_make_batch <= tries:
                raise RuntimeError(
                    f"kept {n_groups} of {target} groups after {tries} generation rounds "
                    "(trainer.max_try_make_batch); with online filtering most groups have all-equal "
                    "rewards: widen algorithm.filter_low/filter_high, raise max_try_make_batch, or turn "
                    "online_filtering off"
                )
        if algo.online_filtering:
            metrics["filter/tries"] = float(tries)
        size = target * self.config.worker.rollout.n
        merged = kept[0] if len(kept) == 1 else merge_rollouts(kept, 1, self.data.pad_token_id)
        if len(merged) > size:
            merged = merged.select(list(range(size)))
        baseline = torch.cat(baselines)[:size] if baselines else None
        return merged, baseline, metrics

    def _filter_values(self, batch: RolloutBatch) -> torch.Tensor:
        """Each sample's `algorithm.filter_key` reward part; an error naming the parts the reward
        function returns when it has no such part (instead of filtering every group out)."""
        key, scored = self.config.algorithm.filter_key, batch.scored_parts()
        missing = [i for i, parts in enumerate(scored) if key not in parts]
        if missing:
            raise ValueError(
                f"algorithm.filter_key={key!r}: the reward function returned no {key!r} score (it returned "
                f"{sorted(scored[missing[0]])}); set algorithm.filter_key to one of them"
            )
        return torch.tensor([float(parts[key]) for parts in scored])

    def _score(self, batch: RolloutBatch) -> dict[str, float]:
        """Decode, score in the reward workers, and put the score on each response's last token."""
        lengths = batch.response_mask.sum(-1).tolist()
        skip = self.config.worker.reward.skip_special_tokens
        extras = batch.extras
        if batch.trajectories is not None:  # multi-turn: the final answer, and the whole trajectory
            texts = [info["final_response"] for info in batch.trajectories]
            extras = [{**extra, "trajectory": info} for extra, info in zip(batch.extras, batch.trajectories)]
        else:
            texts = [self.tokenizer.decode(row[:length], skip_special_tokens=skip)
                     for row, length in zip(batch.responses.tolist(), lengths)]  # fmt: skip
        inputs = build_reward_inputs(texts, lengths, batch.prompts, batch.ground_truths, extras)
        result = self.rewards.score(inputs)
        batch.reward_parts = result.scores
        overall = torch.tensor([s["overall"] for s in result.scores], dtype=torch.float32)
        batch.token_level_scores = scores_to_token_level(overall, batch.response_mask)
        return result.metrics()

    def _remax_baselines(self, prompts: PromptBatch, batch: RolloutBatch, round_: int) -> torch.Tensor:
        """ReMax: each sample's baseline is the reward of a greedy response to its prompt. [N]"""
        greedy = self._generate(prompts, {"n": 1, "temperature": 0.0}, round_)
        self._score(greedy)
        by_uid = {
            uid: parts["overall"] for uid, parts in zip(greedy.group_ids.tolist(), greedy.scored_parts())
        }
        return torch.tensor([by_uid[uid] for uid in batch.group_ids.tolist()])

    # ------------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        overrides = dict(self.config.worker.rollout.val_override_config)
        parts: list[dict[str, float]] = []
        samples: list[dict[str, Any]] = []
        lengths: list[int] = []
        trajectories: list[dict[str, Any]] = []
        start = time.perf_counter()
        assert self.data.val_loader is not None  # the loop validates only when there is val data
        for prompts in self.data.val_loader:
            batch = self._generate(prompts, overrides)
            self._score(batch)
            parts.extend(batch.scored_parts())
            lengths.extend(batch.response_mask.sum(-1).tolist())
            trajectories.extend(batch.trajectories or [])
            if len(samples) < self.config.trainer.val_generations_to_log:
                samples.extend(self._generation_samples(batch))
        metrics = mean_reward_parts(parts, "val")
        metrics["val/response_length"] = sum(lengths) / max(len(lengths), 1)
        metrics.update(multi_turn_metrics(trajectories, "val_multi_turn"))
        metrics["timing/validation"] = time.perf_counter() - start
        if samples:
            self.tracker.log_generations(
                samples[: self.config.trainer.val_generations_to_log], self.global_step
            )
        return metrics

    def _generation_samples(self, batch: RolloutBatch) -> list[dict[str, Any]]:
        lengths = batch.attention_mask[:, batch.prompt_length :].sum(-1).tolist()  # multi-turn: all turns
        return [
            {"prompt": prompt[-200:], "response": self.tokenizer.decode(row[:n], skip_special_tokens=True),
             "ground_truth": truth, "score": parts.get("overall")}
            for prompt, row, n, truth, parts in zip(batch.prompts, batch.responses.tolist(), lengths,
                                                     batch.ground_truths, batch.scored_parts())
        ]  # fmt: skip

    # ------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, val_score: float | None) -> str:
        model_only = self.config.trainer.save_model_only

        def write_actor(folder: str) -> None:
            self.ranks.call_all("save_checkpoint", folder, model_only)

        state = {
            "dataloader": self.data.state_dict(),
            "kl_coef": self.kl_ctrl.value,
            "model_only": model_only,
        }
        return self.checkpoints.save(self.global_step, write_actor, state, val_score)

    def _resume(self) -> None:
        trainer = self.config.trainer
        path = trainer.load_checkpoint_path or (
            self.checkpoints.latest() if trainer.find_last_checkpoint else None
        )
        if path is None:
            return
        state = read_state(path)
        if state.get("model_only"):
            raise ValueError(
                f"{path} was saved with trainer.save_model_only=true: it holds weights only and cannot be "
                "resumed; start a new run from its actor/huggingface folder (worker.actor.model.model_path)"
            )
        self.ranks.call_all("load_checkpoint", os.path.join(path, "actor"))
        self.data.load_state_dict(state["dataloader"])
        self.kl_ctrl.value = state.get("kl_coef", self.kl_ctrl.value)
        self.global_step = state["global_step"]
        print(f"[vlrl] resumed from {path} at step {self.global_step}", flush=True)

    def close(self) -> None:
        self.tracker.close()
        self.rewards.close()
        self.ranks.shutdown()


def _mean_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    keys = per_rank[0].keys()
    return {
        k: sum(m[k] for m in per_rank) / len(per_rank)
        for k in keys
        if all(math.isfinite(m[k]) for m in per_rank)
    }


def _step_seed(seed: int, step: int) -> int:
    """Sampling seed of a step: a function of (seed, step) only, so a resumed run samples the same."""
    return (seed * 1_000_003 + step) % (2**31 - 1)
