"""Check b: one `RankWorker` end to end on a one-rank world (NCCL on CUDA) with the HF rollout engine.

setup -> generate -> log-probs -> 3 updates -> checkpoint -> (1 more update) -> resume ->
model-only save, with the KL loss (so a reference policy), reference offload and optimizer
offload on. CUDA memory (allocated / reserved / peak) is recorded after every phase. It proves:
- every phase runs on the device with the real classes (no Ray: the worker is called directly);
- the reference agrees with the untouched actor, and the updates move the actor;
- resume restores the saved weights exactly (log-probs equal the ones taken before the save,
  not the ones after the extra update) and the optimizer states keep their dtypes and devices;
- the model-only save holds the actor's weights.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from vlrl.batch.rows import KeptRows, one_value_per_row
from vlrl.batch.samples import StepSamples
from vlrl.tools.gpu_check.context import Context, memory, sync, world_env
from vlrl.tools.gpu_check.inputs import make_config, prompt_batch, scores_on_last_token
from vlrl.tools.gpu_check.report import Outcome

UPDATES = 3


def worker_config(ctx: Context, model_dir: str):
    """HF rollout, GRPO with the KL loss, reference and optimizer offload, two mini-batches per update."""
    prompts = 2 if ctx.small else 4  # x n=2 responses; each mini-batch takes half of them
    return make_config(
        model_dir,
        ctx.device,
        **{
            "worker.rollout.name": "hf",
            "worker.rollout.n": 2,
            "worker.rollout.dtype": "bf16" if ctx.cuda else "fp32",
            "worker.rollout.sync_bucket_mb": 4,
            "worker.ref.offload.offload_params": True,
            "worker.actor.offload.offload_optimizer": True,
            "worker.actor.global_batch_size": prompts // 2,  # two optimizer steps per update
            "worker.actor.micro_batch_size_per_device_for_update": 2,
            "algorithm.adv_estimator": "grpo",
            "algorithm.use_kl_loss": True,
            "algorithm.kl_penalty": "low_var_kl",
            "algorithm.kl_coef": 0.1,
            "data.rollout_batch_size": prompts,
            "data.max_response_length": 8 if ctx.small else 32,
        },
    )


def optimizer_layout(optimizer: torch.optim.Optimizer) -> dict[str, list[str]]:
    """Sorted distinct (dtype, device type) of every optimizer state tensor, by state key."""
    layout: dict[str, set[str]] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                layout.setdefault(key, set()).add(f"{local.dtype}@{local.device.type}")
    return {k: sorted(v) for k, v in sorted(layout.items())}


def _masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b)[mask.bool()].abs().max())


def check_rank_worker(ctx: Context, outcome: Outcome) -> None:
    from vlrl.algorithms import compute_advantages
    from vlrl.workers.fsdp import full_state_dict
    from vlrl.workers.rank_worker import RankWorker

    phases: dict[str, dict[str, float]] = {}
    model_dir = ctx.tiny_model("qwen2_5_vl")
    config = worker_config(ctx, model_dir)
    outcome.details["config"] = {"rollout": "hf", "use_kl_loss": True, "ref_offload": True,
                                 "optimizer_offload": True, "updates": UPDATES}  # fmt: skip
    timings: dict[str, float] = {}
    outcome.details.update(memory=phases, seconds=timings)  # filled as the phases run

    def phase(name: str, start: float) -> None:
        sync(ctx.device)
        timings[name] = round(time.perf_counter() - start, 3)
        phases[name] = memory(ctx.device)

    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    addr, port = world_env()
    worker = RankWorker(config, 0, 1, addr, port)
    try:
        t = time.perf_counter()
        worker.setup(limit_images=1, optimizer_steps=8)
        phase("setup", t)
        outcome.expect(
            worker.device.type == ctx.device.type, f"worker runs on {worker.device}, not {ctx.device}"
        )

        prompts = prompt_batch(model_dir, config.data, config.data.rollout_batch_size, 56, ctx.seed)
        t = time.perf_counter()
        batch = worker.generate(prompts, keep_for=1)  # published: the update takes these rows
        assert batch is not None  # a world of one: this rank reports its rollouts
        phase("generate", t)
        mask = batch.response_mask
        outcome.details["generated"] = {"rows": len(batch), "response_tokens": int(mask.sum())}
        outcome.expect(len(batch) == len(prompts) * 2, f"generate returned {len(batch)} rows")

        t = time.perf_counter()
        old, ref = _old_and_ref(worker, batch)
        phase("log_probs", t)
        outcome.expect(ref is not None, "no reference log-probs although the KL loss is on")
        ref_gap = _masked_max(old, ref, mask) if ref is not None else float("nan")
        # On CUDA the reference keeps bf16 weights while the actor computes in bf16 from fp32 masters.
        outcome.expect(ref_gap <= (0.1 if ctx.cuda else 1e-5), f"reference vs untouched actor: {ref_gap:.3g}")
        outcome.expect(bool(torch.isfinite(old).all()), "non-finite old log-probs")
        scores = scores_on_last_token(batch, ctx.seed)
        advantages, _ = compute_advantages("grpo", scores, mask, batch.group_ids, norm_by_std=True)
        per_row = one_value_per_row(advantages, mask)
        assert per_row is not None  # GRPO: one value per response
        kept = KeptRows(list(range(len(batch))), {}, per_row={"advantages": per_row})

        metrics = []
        for i in range(UPDATES):
            _old_and_ref(worker, batch)  # the update trains on the rows take_rows kept
            t = time.perf_counter()
            step_metrics, _ = worker.update(kept)
            phase(f"update_{i + 1}", t)
            metrics.append({k: step_metrics.get(k) for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm",
                                                             "perf/actor_tokens_per_s")})  # fmt: skip
        outcome.details["update_metrics"] = metrics
        for m in metrics:
            outcome.expect(
                all(v is not None and v == v for v in m.values()), f"missing/NaN update metric: {m}"
            )
        offloaded = optimizer_layout(worker.actor.optimizer)
        outcome.details["optimizer_after_update"] = offloaded
        if ctx.cuda:  # offload_optimizer: states wait on the CPU between updates
            outcome.expect(all(all(e.endswith("@cpu") for e in v) for k, v in offloaded.items() if k != "step"),
                           f"optimizer states not offloaded between updates: {offloaded}")  # fmt: skip

        before_save, _ = _old_and_ref(worker, batch)
        moved = _masked_max(before_save, old, mask)
        outcome.expect(moved > 1e-4, f"3 updates did not change the log-probs (max change {moved:.3g})")
        layout_saved = optimizer_layout(worker.actor.optimizer)
        ckpt = str(ctx.workdir / "worker_checkpoint")
        t = time.perf_counter()
        worker.save_checkpoint(ckpt, model_only=False)
        phase("checkpoint", t)

        _old_and_ref(worker, batch)
        worker.update(kept)  # move away from the saved state, so resume has something to restore
        after_extra, _ = _old_and_ref(worker, batch)
        t = time.perf_counter()
        worker.load_checkpoint(ckpt)
        phase("resume", t)
        resumed, _ = _old_and_ref(worker, batch)
        resume_gap, extra_gap = (
            _masked_max(resumed, before_save, mask),
            _masked_max(after_extra, before_save, mask),
        )
        # Same weights, same kernels: equal up to nondeterministic CUDA reductions, if any.
        resume_tol = 1e-4 if ctx.cuda else 1e-6
        outcome.expect(
            resume_gap <= resume_tol, f"resumed log-probs differ from the saved ones by {resume_gap:.3g}"
        )
        outcome.expect(
            extra_gap > resume_gap, "the extra update did not move the weights: resume proves nothing"
        )
        layout_resumed = optimizer_layout(worker.actor.optimizer)
        outcome.details["optimizer_layout"] = {"saved": layout_saved, "resumed": layout_resumed}
        outcome.expect(layout_resumed == layout_saved,
                       f"resume changed optimizer dtypes/devices: {layout_saved} -> {layout_resumed}")  # fmt: skip

        hf_dir = str(ctx.workdir / "worker_model_only")
        t = time.perf_counter()
        worker.save_checkpoint(hf_dir, model_only=True)
        phase("model_only_save", t)
        outcome.details["model_only_weight_gap"] = gap = _saved_weight_gap(
            os.path.join(hf_dir, "huggingface"),
            full_state_dict(worker.actor.model.module),
            worker.actor.model.hf_config,
        )
        outcome.expect(gap == 0.0, f"model-only save differs from the actor's weights by {gap:.3g}")
    finally:
        worker.shutdown()
    outcome.summary.update(
        ref_gap=ref_gap, moved=moved, resume_gap=resume_gap, seconds_setup=timings.get("setup"),
        seconds_generate=timings.get("generate"),
    )  # fmt: skip
    if ctx.cuda:
        outcome.summary["peak_mib"] = max(p["peak_allocated_mib"] for p in phases.values())


def _saved_weight_gap(folder: str, state: dict[str, torch.Tensor], hf_config: Any) -> float:
    """Largest |saved - actor| over the actor's tensors; the folder is loaded the way users load it
    (`from_pretrained`, which also maps the on-disk names back to the module's)."""
    from vlrl.models.loading import model_class

    model = model_class(hf_config).from_pretrained(folder, dtype=torch.float32)
    saved = model.state_dict()
    missing = [k for k in state if k not in saved]
    if missing:
        raise KeyError(f"model-only save lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return max(float((saved[k].float() - v.float()).abs().max()) for k, v in state.items())


def _old_and_ref(worker: Any, samples: StepSamples) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rank worker's old and reference log-probs [N, R] of all the rows it generated, which it
    then keeps for an update (as in a step: `take_rows`, whose old-log-prob pass follows the step
    plan; the old ones of every row are computed here, on the same untouched actor)."""
    rows = list(range(len(samples)))
    worker.take_rows(samples.plan(rows), rows)
    kept = worker.training_or_fail().kept  # kept in `rows` order
    assert kept is not None
    return worker.actor.compute_log_probs(kept), kept.ref_log_probs
