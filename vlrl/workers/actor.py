"""The actor: the trained policy, sharded with FSDP2 (log-probs, PPO-style update, checkpoints).

Update of one step's rows on this rank (`update_policy`):

    for each of ppo_epochs:
      for each mini-batch (samples_per_minibatch_per_rank rows)        -> one optimizer step
        num_tokens, num_seqs = valid tokens / sequences of the mini-batch, summed over ranks
        for each micro-batch (a sample count, or a token budget with dynamic batching)
          loss = policy loss [+ kl_coef * KL loss] [- entropy_coeff * entropy], normalized by the
                 mini-batch totals, so the micro-batch losses of all ranks SUM to the mini-batch loss
          backward(loss * world_size)    # FSDP averages grads over ranks; x W turns it into the sum
                                         # (x world / ulysses_size with sequence parallelism)
                                         # hybrid sharding: the replicas' all-reduce on the last only
        clip the global grad norm, skip the step if it is not finite, step the LR schedule

So the gradient does not depend on how rows are split into ranks and micro-batches
(tests/actor/test_multirank.py checks it against a plain single-process full-batch gradient).

Ulysses (ulysses_size = sp > 1): the sp ranks of a group hold the same rows, so the totals count
each rank's rows once per group (sum / sp), and every rank of a group computes the group's whole
micro-batch loss from the gathered log-probs. The gather's backward sums the group's gradients (sp
copies of the same loss), so the factor is the number of groups, world / sp, instead of the world
size (tests/actor/test_ulysses.py: gradients equal those of sp = 1).
"""

from __future__ import annotations

import copy
import logging
import os
import time
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from vlrl.algorithms import (
    aggregate_loss,
    compute_kl_loss,
    compute_policy_loss,
    count_tokens_and_seqs,
    low_var_kl_clamped,
    masked_mean,
)
from vlrl.batch.rows import RolloutBatch
from vlrl.config import ActorConfig, AlgorithmConfig
from vlrl.models.flops import batch_vision_grids, peak_flops, training_flops, vision_training_flops
from vlrl.models.loading import model_class
from vlrl.models.lora import ADAPTER, lora_scaling_of, merged_named_tensors
from vlrl.models.moe import write_checkpoint_layout
from vlrl.workers.checkpoint_io import (
    SafeFileSystemReader,
    load_extra_state,
    restore_state_placement,
    rng_state,
    save_extra_state,
    set_rng_state,
    state_placement,
)
from vlrl.workers.fsdp import (
    fsdp_offloads_to_cpu,
    full_state_dict,
    is_hybrid,
    move_optimizer_state,
    move_params,
    pending_replica_reduce,
    set_replica_all_reduce,
)
from vlrl.workers.optim import (
    any_nonfinite,
    build_lr_scheduler,
    build_optimizer,
    clip_and_step,
    nonfinite_screen,
)
from vlrl.workers.sharded_model import ShardedModel, ShardSpec

logger = logging.getLogger(__name__)


class NonFiniteTraining(RuntimeError):
    """The update produced inf/nan weights, or too many non-finite gradients in a row."""


TOKEN_METRICS = ("pg_clipfrac_higher", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_clamped_share")
LOSS_METRICS = ("pg_loss", "kl_loss")


class _UpdateStats:
    """Sums that become the update's metrics (read from the device and reduced over ranks once, at the end).

    The micro-batch loop only adds device tensors (`add_micro`): reading a number there would wait
    for every queued kernel, once per micro-batch."""

    # columns of `sums`: token-mean metric x local tokens, then the local tokens, then this rank's
    # share of each mini-batch loss
    COLUMNS = (*TOKEN_METRICS, "tokens", *LOSS_METRICS)

    def __init__(self, with_kl_loss: bool) -> None:
        self.with_kl_loss = with_kl_loss  # actor/kl_loss is logged only when there is one
        self.sums: Tensor | None = None  # [len(COLUMNS)] float64 on the model's device
        self.grad_norms: list[float] = []
        self.lrs: list[float] = []
        self.steps = 0
        self.skipped = 0
        self.no_advantage = 0

    def add_micro(
        self, metrics: dict[str, Tensor], entropy_sum: Tensor, tokens: Tensor, pg: Tensor, kl: Tensor
    ) -> None:
        """Add one micro-batch: `metrics` token means (0-dim), the entropy summed over its tokens,
        its token count and its losses (all 0-dim device tensors; nothing is read here)."""
        token_sums = [entropy_sum if name == "entropy" else metrics[name] * tokens for name in TOKEN_METRICS]
        row = torch.stack([*token_sums, tokens, pg, kl]).detach().to(torch.float64)  # [len(COLUMNS)]
        self.sums = row if self.sums is None else self.sums + row

    def local_sums(self) -> list[float]:
        """This rank's sums as floats: the update's one read of its metrics from the device."""
        if self.sums is None:
            return [0.0] * len(self.COLUMNS)
        return self.sums.tolist()

    def finish(self, reduce) -> dict[str, float]:
        sums = reduce(self.local_sums())
        tokens = max(sums[len(TOKEN_METRICS)], 1.0)
        out = {
            f"actor/{k}": v / tokens
            for k, v in zip(TOKEN_METRICS, sums)
            if k != "kl_clamped_share" or self.with_kl_loss
        }
        for k, v in zip(LOSS_METRICS, sums[len(TOKEN_METRICS) + 1 :]):
            if k != "kl_loss" or self.with_kl_loss:
                out[f"actor/{k}"] = v / max(self.steps, 1)
        finite = [g for g in self.grad_norms if np.isfinite(g)]
        # nan only when a step was attempted and every norm was non-finite; 0 when none was taken
        out["actor/grad_norm"] = (
            float(np.mean(finite)) if finite else float("nan") if self.grad_norms else 0.0
        )
        out["actor/lr"] = float(np.mean(self.lrs)) if self.lrs else 0.0
        out["actor/skipped_steps"] = float(self.skipped)
        out["actor/no_advantage_steps"] = float(self.no_advantage)
        return out


def _on(host: Tensor, device: torch.device) -> Tensor:
    """A host batch tensor on `device`, copied without waiting for the device's queue (a blocking
    host-to-GPU copy synchronizes the stream; the host tensor is a fresh `select` of the batch)."""
    return host.to(device, non_blocking=True)


def _derived(value: float | None, key: str) -> float:
    """A config value that `PPOConfig.derive` fills at start-up (None only in a config never finalized)."""
    if value is None:
        raise ValueError(f"{key} is unset: PPOConfig.finalize() derives it at start-up")
    return value


def manual_offload(cfg: ActorConfig, device: torch.device) -> tuple[bool, bool]:
    """(offload_params, offload_optimizer) that the actor does itself between phases.

    None on CPU (no device memory to free). None with FSDP's CPU offload either: the shards already
    live on CPU, so AdamW creates its states there too, and moving either to the GPU would break
    FSDP's placement (the optimizer step needs its states where the parameters are)."""
    wanted = cfg.offload.offload_params or cfg.offload.offload_optimizer
    if device.type != "cuda":
        if wanted:
            logger.info("worker.actor.offload is ignored on CPU: the weights already live in host memory")
        return False, False
    if fsdp_offloads_to_cpu(cfg.fsdp, device):
        if wanted:
            logger.info(
                "worker.actor.offload is ignored with fsdp.enable_cpu_offload: FSDP keeps the shards on CPU"
            )
        return False, False
    return cfg.offload.offload_params, cfg.offload.offload_optimizer


class Actor:
    """The policy being trained: a trainable `ShardedModel` (`model`; `model.module` is the FSDP2-wrapped
    HF model, its state_dict holds DTensors), its optimizer and LR schedule.

    Public API: `compute_log_probs`, `update_policy`, `save_checkpoint` / `load_checkpoint`,
    `save_hf`, `offload_to_cpu` / `load_to_device`, `set_total_steps`.
    """

    def __init__(
        self,
        cfg: ActorConfig,
        model_path: str,
        processor: Any,
        device: torch.device | str,
        *,
        algorithm: AlgorithmConfig,
        optimizer_steps_per_step: int,
        samples_per_minibatch: int,
        temperature: float,
        total_steps: int | None = None,
    ) -> None:
        """`algorithm`: the KL-loss settings (`use_kl_loss`, `kl_penalty`, `kl_coef`).
        `optimizer_steps_per_step`: optimizer steps per trainer step (the LR schedule counts warm-up
        in trainer steps); `samples_per_minibatch`: rows of this rank per optimizer step;
        `temperature`: the rollout's sampling temperature, which the update's log-probs are taken at;
        `total_steps`: optimizer steps of the whole run (None: unknown, see `set_total_steps`)."""
        self.cfg = cfg
        self.algorithm = algorithm
        self.optimizer_steps_per_step = optimizer_steps_per_step
        self.samples_per_minibatch = samples_per_minibatch
        self.temperature = temperature
        self.model = ShardedModel(ShardSpec.of_actor(cfg, model_path), processor, device, trainable=True)
        self.lora = cfg.model.lora.rank > 0  # then only the adapters train, save and load
        # the optimizer, its states and grad-norm clipping cover the trainable parameters only
        self.params = [p for p in self.model.module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optim)
        self.set_total_steps(total_steps)
        self.global_step = 0  # optimizer steps attempted (skipped ones included)
        self.skipped_steps = 0  # over the whole run
        self.skipped_in_a_row = 0  # optimizer steps skipped for a non-finite gradient norm, in a row
        self.offload_params, self.offload_optimizer = manual_offload(cfg, self.model.device)

    def compute_log_probs(self, batch: RolloutBatch) -> Tensor:
        """Log-probs [N, R] (fp32, CPU) of `batch.responses` under the current policy at the
        sampling temperature (no grad)."""
        return self.model.compute_log_probs(batch, self.temperature)

    def set_total_steps(self, total_steps: int | None) -> None:
        """Optimizer steps of the whole run (for warm-up ratio and cosine); rebuilds the schedule."""
        self.total_steps = total_steps
        self.scheduler = build_lr_scheduler(
            self.optimizer, self.cfg.optim, total_steps or 0, self.optimizer_steps_per_step
        )

    def _check_schedule(self) -> None:
        optim = self.cfg.optim
        needs_total = optim.lr_scheduler_type == "cosine" or (
            optim.lr_warmup_steps is None and optim.lr_warmup_ratio > 0
        )
        if needs_total and not self.total_steps:
            raise ValueError(
                "the LR schedule (cosine or lr_warmup_ratio) needs the number of optimizer steps: set "
                "trainer.max_steps, pass total_steps= to Actor, or call actor.set_total_steps(n)"
            )

    # ----------------------------------------------------------------------------- update
    def update_policy(self, batch: RolloutBatch, on_policy: bool = False) -> dict[str, float]:
        """`ppo_epochs` passes of mini-batch updates over this rank's rows; returns mean metrics.

        `on_policy`: the update starts from the weights that generated the batch (the step plan's
        `old_log_probs` `update` or `mixed`, vlrl.algorithms.plan), so the first mini-batch's
        forward gives its old log-probs (detached: its first ratio is exactly 1) and its rows of
        `batch.old_log_probs` are not read; with a single mini-batch `batch.old_log_probs` may be
        None. The computed ones are filled into `batch.old_log_probs` (later epochs read them).
        """
        if batch.advantages is None:
            raise ValueError("update_policy needs batch.advantages")
        if batch.old_log_probs is None and not on_policy:
            raise ValueError(
                "update_policy needs batch.old_log_probs unless on_policy (the first mini-batch's are its own)"
            )
        if self.algorithm.use_kl_loss and batch.ref_log_probs is None:
            raise ValueError("algorithm.use_kl_loss=true needs batch.ref_log_probs")
        self._check_schedule()
        model = self.model
        if self.offload_optimizer:
            move_optimizer_state(self.optimizer, model.device)
        model.module.train()
        stats = _UpdateStats(with_kl_loss=self.algorithm.use_kl_loss)
        image_anchor = model.any_rank_has_media(batch)
        size = max(self.samples_per_minibatch, 1)
        minis = [list(range(i, min(i + size, len(batch)))) for i in range(0, len(batch), size)]
        count = int(model.all_reduce([len(minis)], dist.ReduceOp.MAX)[0])
        minis += [[] for _ in range(count - len(minis))]
        totals, has_advantage = self._mini_batch_totals(batch, minis)
        micro_plans = model.plan_mini_batches(batch, minis, self.cfg.micro_batch_size_per_device_for_update)
        first_step = self.global_step + 1
        start = time.perf_counter()
        if batch.old_log_probs is None:
            if sum(1 for rows in minis if rows) > 1:
                raise ValueError(
                    f"update_policy needs batch.old_log_probs for all but the first of its {len(minis)} "
                    "mini-batches (on_policy computes the first one's)"
                )
            batch.old_log_probs = torch.zeros(batch.responses.shape, dtype=torch.float32)
        computed_old = batch.tensor("old_log_probs")  # [N, R]; the first mini-batch's rows filled below
        for epoch in range(self.cfg.ppo_epochs):
            for index, rows in enumerate(minis):
                own_old = on_policy and epoch == 0 and index == 0
                mini = batch.select(rows)
                log_probs = self.forward_backward(
                    mini, stats, image_anchor, own_old, totals[index], micro_plans[index]
                )
                if own_old and rows:
                    computed_old[rows] = log_probs.cpu()  # the mini-batch's one copy to the host
                if self.cfg.skip_steps_without_advantage and not has_advantage[index]:
                    self.skip_step(stats)
                else:
                    self.optimizer_step(stats)
        self._check_weights_after(stats, first_step)
        seconds = time.perf_counter() - start
        if self.offload_optimizer:
            move_optimizer_state(self.optimizer, "cpu")
        if model.vision is not None:
            model.vision.clear()  # the update is the step's last pass over these images
        return {**stats.finish(model.all_reduce), **self._perf_metrics(batch, seconds)}

    def _perf_metrics(self, batch: RolloutBatch, seconds: float) -> dict[str, float]:
        """Real tokens/s and MFU of this update (decoder + vision tower model FLOPs; see
        vlrl.models.flops), rank mean."""
        lengths = batch.attention_mask.sum(-1).tolist()
        epochs = self.cfg.ppo_epochs
        model = self.model
        # logits are computed for the response tokens only (the lm head's share of the FLOPs)
        flops = training_flops(model.hf_config, lengths, int(batch.response_mask.sum()))
        # a frozen tower (freeze_vision_tower; LoRA leaves it without adapters) runs forward only
        grids = batch_vision_grids(model.hf_config, batch.images, batch.videos)
        trainable_vision = not (self.cfg.model.freeze_vision_tower or self.lora)
        flops = epochs * (flops + vision_training_flops(model.hf_config, grids, trainable_vision))
        peak = peak_flops(model.device) or float("nan")
        # a rank of a Ulysses group runs 1/sp of its rows' tokens; the sum over ranks counts them once
        sp = model.spec.ulysses_size
        tokens_per_s, mfu = model.all_reduce(
            [epochs * sum(lengths) / seconds / sp, flops / sp / seconds / peak]
        )
        return {"perf/actor_tokens_per_s": tokens_per_s, "perf/actor_mfu": mfu / model.world_size}

    def forward_backward(
        self,
        mini: RolloutBatch,
        stats: _UpdateStats,
        image_anchor: bool | tuple[bool, bool],
        own_old: bool = False,
        totals: tuple[float, float] | None = None,
        micro_plan: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Accumulate the gradient of one mini-batch's loss (summed over ranks) into `.grad`.

        Returns the log-probs [len(mini), R] it computed (detached, on the model's device: copying
        them to the host is the caller's choice). `own_old`: they are also the old log-probs (the
        ratio is exactly 1; `mini.old_log_probs` is not read). `totals`: the mini-batch's (tokens,
        sequences) over all ranks and `micro_plan` its micro-batches, when the caller has them for the
        whole update (`_mini_batch_totals`, `ShardedModel.plan_mini_batches`); else agreed over ranks here.

        The micro-batch loop reads nothing from the device: the inputs are indexed on the host
        (vlrl.models.packing), host rows go to the device with non-blocking copies, and the metrics
        stay device tensors in `stats`. The token totals come from the host mask."""
        cfg, algo, model = self.cfg, self.algorithm, self.model
        dev, sp = model.device, model.spec.ulysses_size
        computed = torch.zeros(mini.responses.shape, dtype=torch.float32, device=dev)
        if totals is None:  # a Ulysses group's ranks hold the same rows: count them once
            tokens, seqs = model.all_reduce(list(count_tokens_and_seqs(mini.response_mask)))
            totals = (tokens / sp, seqs / sp)
        num_tokens, num_seqs = totals
        agg: dict[str, Any] = {
            "loss_avg_mode": cfg.loss_avg_mode,
            "num_tokens": num_tokens,
            "num_seqs": num_seqs,
        }
        if micro_plan is None:
            micro_plan = model.plan_micro_batches(mini, cfg.micro_batch_size_per_device_for_update)
        plan = micro_plan
        # HSDP: the cross-replica all-reduce only on the last micro-batch's backward (vlrl.workers.fsdp)
        defer = len(plan) > 1 and is_hybrid(model.module)
        for index, rows in enumerate(plan):
            if defer:
                set_replica_all_reduce(model.module, index == len(plan) - 1)
            mb = mini.select(rows)
            out = model.forward_micro_batch(
                mb, self.temperature, image_anchor, with_entropy=True, entropy_grad=cfg.entropy_coeff != 0
            )
            mask = _on(mb.response_mask, dev)  # [n, R]
            if rows:
                computed[_on(torch.tensor(rows), dev)] = out.log_probs.detach()
            old = out.log_probs.detach() if own_old else _on(mb.tensor("old_log_probs"), dev)
            pg, metrics = compute_policy_loss(
                cfg.policy_loss,
                old,
                out.log_probs,
                _on(mb.tensor("advantages"), dev),
                mask,
                clip_ratio_low=cfg.clip_ratio_low,
                clip_ratio_high=cfg.clip_ratio_high,
                clip_ratio_dual=_derived(cfg.clip_ratio_dual, "worker.actor.clip_ratio_dual"),
                tau_positive=cfg.tau_positive,
                tau_negative=cfg.tau_negative,
                **agg,
            )
            loss, kl = pg, torch.zeros((), device=dev)
            metrics["kl_clamped_share"] = torch.zeros((), device=dev)
            if algo.use_kl_loss:
                ref = _on(mb.tensor("ref_log_probs"), dev)
                clamp = algo.low_var_kl_clamp if algo.kl_penalty == "low_var_kl" else None
                kl = compute_kl_loss(
                    out.log_probs,
                    ref,
                    mask,
                    algo.kl_penalty,
                    **agg,
                    low_var_clamp=clamp,
                    old_log_probs=old if algo.kl_loss_ratio_weighted else None,
                )
                loss = loss + algo.kl_coef * kl
                # the tokens whose KL gradient the bound removes (token mean, like the clip fractions)
                metrics["kl_clamped_share"] = masked_mean(
                    low_var_kl_clamped(out.log_probs, ref, clamp).float(), mask
                )
            entropy_all = out.entropy
            assert entropy_all is not None  # asked for with_entropy=True
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * aggregate_loss(
                    entropy_all, mask, cfg.loss_avg_mode, num_tokens, num_seqs
                )
            # x groups: FSDP averages the ranks' gradients, we want the sum over the data-parallel
            # groups (with sp = 1 the world size; see the module docstring for sp > 1)
            ((loss + out.anchor) * model.dp_size).backward()
            valid = mask > 0
            entropy_sum = torch.where(valid, entropy_all.detach(), 0.0).sum()
            # the group's ranks each add the same loss: count it once
            stats.add_micro(metrics, entropy_sum, valid.sum(), pg.detach() / sp, kl.detach() / sp)
        if defer and pending_replica_reduce(model.module):
            raise RuntimeError(
                "an FSDP unit got gradients on an earlier micro-batch but none on the last one, so "
                "they were never all-reduced across replicas (hybrid sharding)"
            )
        return computed

    def optimizer_step(self, stats: _UpdateStats) -> None:
        """Clip, step (or skip a non-finite step) and advance the LR schedule."""
        stats.lrs.append(self.optimizer.param_groups[0]["lr"])
        norm, skipped = clip_and_step(self.optimizer, self.params, self.cfg.max_grad_norm)
        self._advance_schedule()
        self.global_step += 1
        stats.steps += 1
        stats.grad_norms.append(norm)
        stats.skipped += int(skipped)
        self.skipped_steps += int(skipped)
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        limit = self.cfg.max_nonfinite_steps
        if limit > 0 and self.skipped_in_a_row >= limit:
            raise NonFiniteTraining(
                f"{limit} optimizer steps in a row had a non-finite gradient norm ({norm}); each was skipped. "
                "The loss or the weights may have become inf/nan (a learning rate too high, or a corrupt "
                "checkpoint): resume from an earlier checkpoint or lower worker.actor.optim.lr "
                "(worker.actor.max_nonfinite_steps sets the limit)"
            )

    def _check_weights_after(self, stats: _UpdateStats, first_step: int) -> None:
        """Stop the run when this update's optimizer steps made the weights inf/nan. Checked once per
        update, not per step (one host sync; a later step of the same update cannot repair them: its
        gradient norm is non-finite and the step skipped). Every rank takes the same branch: the
        skip counts come from all-reduced norms and flags."""
        if stats.steps == stats.skipped + stats.no_advantage or self.weights_finite():
            return
        last = self.global_step
        steps = f"optimizer step {last}" if last == first_step else f"optimizer steps {first_step}-{last}"
        norms = ", ".join(f"{n:.4g}" for n in stats.grad_norms)
        raise NonFiniteTraining(
            f"{steps} made the weights inf/nan (gradient norm {norms}): the optimizer state may be "
            "corrupt or the update too large; the run stops before saving them. Resume from the "
            "latest checkpoint, with a lower worker.actor.optim.lr if it happens again"
        )

    def weights_finite(self) -> bool:
        """Whether every rank's shards hold only finite values (the same answer on every rank).

        One host sync when they are: `nonfinite_screen`'s flag is all-reduced on the device and read
        once (not a read, then a read of the all-reduce). Only a flag (a non-finite value, or a
        2-norm that overflowed) runs the exact check, `any_nonfinite`, on every rank."""
        model = self.model
        local = [(p.to_local() if isinstance(p, DTensor) else p).detach() for p in self.params]
        flag = nonfinite_screen(local, model.device).to(model.device)
        if model.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return True
        bad = any_nonfinite(local)
        return model.all_reduce([float(bad)], dist.ReduceOp.MAX)[0] == 0

    def _mini_batch_totals(
        self, batch: RolloutBatch, minis: list[list[int]]
    ) -> tuple[list[tuple[float, float]], list[bool]]:
        """For each mini-batch: its (tokens, sequences) summed over ranks (a Ulysses group's ranks
        hold the same rows: counted once), and whether any rank's rows have a non-zero advantage on a
        response token. Read from the host batch and all-reduced once for the whole update (the rows
        are the same in every epoch), instead of once per mini-batch."""
        local: list[float] = []
        for rows in minis:
            mask = batch.response_mask[rows]  # [n, R] host
            signal = (batch.tensor("advantages")[rows] * mask).abs().sum() if rows else 0.0
            # nan counts (nan != 0): the step is taken and its norm guarded
            local += [*count_tokens_and_seqs(mask), float(signal != 0)]
        summed = self.model.all_reduce(local)
        sp = self.model.spec.ulysses_size
        totals = [(summed[i] / sp, summed[i + 1] / sp) for i in range(0, len(summed), 3)]
        return totals, [summed[i + 2] > 0 for i in range(0, len(summed), 3)]

    def skip_step(self, stats: _UpdateStats) -> None:
        """Drop the accumulated gradient; the LR schedule and step counts still advance."""
        stats.lrs.append(self.optimizer.param_groups[0]["lr"])
        self.optimizer.zero_grad(set_to_none=True)
        self._advance_schedule()
        self.global_step += 1
        stats.steps += 1
        stats.no_advantage += 1

    def _advance_schedule(self) -> None:
        """One LR-schedule step. A skipped optimizer step advances it on purpose, which torch warns
        about (once per rank) when no optimizer step came before: that warning is dropped."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            self.scheduler.step()

    # -------------------------------------------------------------------------- placement
    def offload_to_cpu(self) -> None:
        """Free device memory for the rollout engine (per `worker.actor.offload`; no-op on CPU)."""
        if self.offload_params:
            move_params(self.model.module, "cpu")
        if self.offload_optimizer:
            move_optimizer_state(self.optimizer, "cpu")

    def load_to_device(self) -> None:
        """Bring the parameters back before log-probs / update (no-op on CPU)."""
        if self.offload_params:
            move_params(self.model.module, self.model.device)

    # -------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Sharded model + optimizer (torch.distributed.checkpoint) and per-rank schedule/RNG state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if not self.weights_finite():  # on every rank alike: no rank enters the collective save alone
            raise NonFiniteTraining(f"the weights hold inf/nan: no checkpoint is written to {path}")
        os.makedirs(path, exist_ok=True)
        module = self.model.module
        model_sd, optim_sd = get_state_dict(module, self.optimizer, options=self._state_dict_options())
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "dcp"))
        extra = {
            "scheduler": self.scheduler.state_dict(),
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "rng": rng_state(),
        }
        save_extra_state(os.path.join(path, f"extra_state_rank{self.model.rank}.pt"), extra)
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote (same world size for the per-rank RNG state)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        options, module = self._state_dict_options(), self.model.module
        # creates missing optim states
        model_sd, optim_sd = get_state_dict(module, self.optimizer, options=options)
        placement = state_placement(self.optimizer)  # before load_state_dict recasts them
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=SafeFileSystemReader(os.path.join(path, "dcp")))
        set_state_dict(
            module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
        del state, model_sd, optim_sd  # the optimizer now holds recast copies; free the loaded originals
        restore_state_placement(self.optimizer, placement)
        if self.offload_optimizer:
            move_optimizer_state(self.optimizer, "cpu")  # where update_policy leaves it between steps
        extra = load_extra_state(os.path.join(path, f"extra_state_rank{self.model.rank}.pt"))
        self.scheduler.load_state_dict(extra["scheduler"])
        self.global_step, self.skipped_steps = extra["global_step"], extra["skipped_steps"]
        set_rng_state(extra["rng"])
        dist.barrier()

    def _state_dict_options(self):
        """With LoRA a checkpoint holds only the adapters (the frozen base is re-read from model_path).

        dcp.load fails on any key of the request missing from the checkpoint, so every adapter
        tensor is read; `strict=False` only lets the frozen base keys stay as they are."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.lora, strict=not self.lora)

    def save_adapter_config(self, path: str) -> None:
        """With LoRA, write peft's `adapter_config.json` (rank, alpha, targets, base model) to `path`."""
        if self.lora:
            configs: Any = self.model.module.peft_config  # {adapter name: peft.LoraConfig}
            configs[ADAPTER].save_pretrained(path)

    def save_hf(self, path: str) -> None:
        """Rank 0 writes a Hugging Face folder (full weights, config, processor/tokenizer). Collective.

        With LoRA the adapters are merged into the weights (plain transformers names)."""
        model = self.model
        state = full_state_dict(model.module)
        if self.lora:
            state = dict(merged_named_tensors(state.items(), lora_scaling_of(model.module)))
        if model.rank == 0:
            config = copy.deepcopy(model.hf_config)
            config.use_cache = True
            text = getattr(config, "text_config", None) or config
            text._attn_implementation = "sdpa"  # our packed attention is not registered elsewhere
            if getattr(config, "vision_config", None) is not None:
                config.vision_config._attn_implementation = "sdpa"  # nor our vision attention
            with torch.device("meta"):
                hf_model = model_class(config).from_config(config)
            hf_model.load_state_dict(state, assign=True, strict=True)
            hf_model.save_pretrained(path)
            write_checkpoint_layout(path, config)  # MoE experts as vLLM reads them
            model.tokenizer_or_processor().save_pretrained(path)
        dist.barrier()


def gathered_grads(module: torch.nn.Module) -> dict[str, Tensor]:
    """Full (unsharded) gradients by parameter name, for tests and debugging. Collective."""
    out = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone()
    return out
