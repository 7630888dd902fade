"""The "at GPU scale" checks: the 3B-shaped actor's update MFU and the log-prob pass's peak memory.

Both use the random-init model with Qwen2.5-VL-3B-Instruct's shapes of `qwen3b_check` (built once
per run, `shaped_3b_model`) and the actor's own code paths: `Actor.update_policy` (token-budget
micro-batches from `ShardedModel.plan_micro_batches`, the configured gradient-checkpointing policy,
the fused AdamW of vlrl.workers.optim on CUDA) and `Actor.compute_log_probs` (per-chunk scoring
from hidden states, vlrl.models.lm_head). MFU is the actor's own `perf/actor_mfu`: decoder and
vision-tower model FLOPs (vlrl.models.flops), so checkpointing's recompute lowers it.

- `update_mfu`: one warm-up and two timed updates with checkpointing "all" at a token budget of
  16,384 tokens per micro-batch; then a lighter policy ("every_k:2": half the layers keep their
  activations) at the largest budget its activations are estimated to fit in the memory the first
  run left free (skipped when that is under 1,024 tokens). Per policy: MFU, tokens/s, peak memory
  and `torch.cuda.memory_stats()["num_alloc_retries"]` (the caching allocator freed its cache and
  retried a cudaMalloc: the update only just fitted).
- `logprob_memory`: 16 rows with 8,192-token responses, the experience pass in one token-budget
  micro-batch; measured peak vs what full [tokens, vocab] bf16 logits alone would take (computed).

On CPU (`--device cpu`, the self-test) both run on the small stand-in; memory counters are CUDA's
only, so they are None there.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

import torch

from vlrl.tools.gpu_check.context import Context, single_rank_world, sync
from vlrl.tools.gpu_check.inputs import make_config, prompt_batch, random_rollout, training_fields
from vlrl.tools.gpu_check.qwen3b_check import build_3b_shaped_model
from vlrl.tools.gpu_check.report import Outcome

MFU_GOAL = 0.35  # issue 14's P5 goal for an H100
LIGHT_POLICY = "every_k:2"
MIN_LIGHT_BUDGET = 1024  # below this the lighter policy's micro-batches are too small to say anything
MARGIN_BYTES = 4 * 2**30  # kept free when sizing the lighter policy's budget (fragmentation, vision)


@dataclass(frozen=True)
class UpdateSizes:
    rows: int
    image: int  # side of the square image every other row has
    responses: list[int]  # response lengths, cycled over the rows
    budget: int  # tokens per micro-batch for "all"
    timed: int  # timed updates after the warm-up


@dataclass(frozen=True)
class LogProbSizes:
    rows: int
    response: int
    image: int


def shaped_3b_model(ctx: Context) -> str:
    """The random-init model with Qwen2.5-VL-3B's shapes (the small stand-in when `ctx.small`),
    written once per run and kept in `ctx`: each write is a 7.5 GB folder (qwen3b_check)."""
    key = "qwen25_vl_3b_shapes"
    if key not in ctx._models:
        folder, _ = build_3b_shaped_model(ctx.workdir / key, ctx.device, ctx.small, ctx.seed)
        ctx._models[key] = folder
    return str(ctx._models[key])


def update_sizes(small: bool) -> UpdateSizes:
    if small:
        return UpdateSizes(rows=4, image=56, responses=[8, 5, 12, 3], budget=64, timed=1)
    # 32 rows, 16 with a 448x448 image (256 image tokens); responses 1-2k: ~56k tokens per update,
    # about four 16k-token micro-batches, one optimizer step
    return UpdateSizes(rows=32, image=448, responses=[2048, 1536, 1024, 1792], budget=16384, timed=2)


def logprob_sizes(small: bool) -> LogProbSizes:
    if small:
        return LogProbSizes(rows=4, response=64, image=56)
    return LogProbSizes(rows=16, response=8192, image=448)


# ------------------------------------------------------------------------------ memory probes
def cuda_counters(device: torch.device) -> dict[str, int] | None:
    """Cumulative allocator counters (None on CPU): retries of cudaMalloc after freeing the cache, OOMs."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
    }


def start_phase(device: torch.device) -> dict[str, int] | None:
    """Reset the peak counter and return the allocator counters to subtract at `end_phase`."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return cuda_counters(device)


def end_phase(device: torch.device, before: dict[str, int] | None) -> dict[str, Any]:
    """Peak allocated / reserved (MiB) since `start_phase` and the counters' growth; CPU: max RSS."""
    sync(device)
    if device.type != "cuda" or before is None:
        import resource

        return {"max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "peak_allocated_mib": None, "num_alloc_retries": None}  # fmt: skip
    after = cuda_counters(device) or {}
    return {
        "peak_allocated_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
        "peak_reserved_mib": round(torch.cuda.max_memory_reserved(device) / 2**20, 1),
        "allocated_mib": round(torch.cuda.memory_allocated(device) / 2**20, 1),
        **{k: after[k] - before[k] for k in before},
    }


def free_device(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_total_bytes(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


# ------------------------------------------------------------------------------ estimates
def full_logits_bytes(tokens: int, vocab: int, bytes_per_value: int = 2) -> int:
    """What [tokens, vocab] logits in bf16 alone would hold (the pre-chunking lm head's output)."""
    return tokens * vocab * bytes_per_value


def layer_activation_bytes_per_token(hf_config: Any) -> int:
    """bf16 activations one decoder layer keeps for backward per token when not checkpointed.

    Counted tensors: the attention block's ~7 hidden-wide ones (norm input/output, q, attention
    output, o-proj input, residual; k/v are narrower with GQA) and the gated MLP's 4 intermediate-wide
    ones (gate, up, activation, product). An estimate, used only to size the lighter policy's budget."""
    text = getattr(hf_config, "text_config", None) or hf_config
    return 2 * (7 * int(text.hidden_size) + 4 * int(text.intermediate_size))


def kept_layers(num_layers: int, interval: int) -> int:
    """Layers that keep their activations under "every_k:interval" (layers 0, K, 2K... recompute)."""
    return num_layers - len(range(0, num_layers, interval))


def light_budget(free_bytes: int, per_token_layer: int, layers_kept: int, cap: int) -> int:
    """Largest power-of-two token budget <= `cap` whose kept activations fit in `free_bytes` (0: none)."""
    if layers_kept <= 0:
        return cap
    fits = free_bytes // (per_token_layer * layers_kept)
    budget = cap
    while budget > fits and budget > 0:
        budget //= 2
    return budget


# ------------------------------------------------------------------------------ batches
def _rollout(ctx: Context, model_dir: str, config: Any, rows: int, image: int, responses: list[int]):
    prompts = prompt_batch(model_dir, config.data, rows, image, ctx.seed)
    return training_fields(random_rollout(model_dir, prompts, 1, responses, 1000, ctx.seed), ctx.seed)


def _batch_info(batch: Any) -> dict[str, Any]:
    lengths = batch.attention_mask.sum(-1).tolist()
    return {"rows": len(batch), "tokens": int(sum(lengths)), "widest": int(batch.input_ids.shape[1]),
            "response_tokens": int(batch.response_mask.sum()),
            "images": sum(len(i) for i in batch.images)}  # fmt: skip


def _actor_config(model_dir: str, ctx: Context, rows: int, response: int, **values: Any):
    settings = {
        "worker.actor.model.enable_gradient_checkpointing": True,
        "worker.actor.dynamic_batching": True,
        "worker.actor.global_batch_size": rows,
        "data.rollout_batch_size": rows,
        "worker.actor.optim.lr": 1e-6,
        "data.max_prompt_length": 1024,
        "data.max_response_length": response,
        "data.max_pixels": 448 * 448,
        **values,
    }
    return make_config(model_dir, ctx.device, **settings)


# ------------------------------------------------------------------------------ update MFU
def _timed_updates(ctx: Context, actor: Any, batch: Any, timed: int) -> dict[str, Any]:
    """One warm-up and `timed` updates of `actor` as it is configured now; the fastest update's actor
    metrics and the memory of the timed ones."""
    out: dict[str, Any] = {"micro_batches": [len(r) for r in actor.model.plan_micro_batches(batch, 1)],
                           "checkpointed_layers": checkpointed_layers(actor.model.module)}  # fmt: skip
    t = time.perf_counter()
    before = start_phase(ctx.device)
    actor.update_policy(batch)  # warm-up: optimizer states, kernels' first calls, allocator
    out["warmup_s"] = round(time.perf_counter() - t, 2)
    out["warmup_memory"] = end_phase(ctx.device, before)
    runs = []
    before = start_phase(ctx.device)
    for _ in range(timed):
        t = time.perf_counter()
        metrics = actor.update_policy(batch)
        sync(ctx.device)
        runs.append((time.perf_counter() - t, metrics))
    out["memory"] = end_phase(ctx.device, before)
    _, best = min(runs, key=lambda r: r[0])
    out.update(update_s=[round(s, 3) for s, _ in runs], mfu=best["perf/actor_mfu"],
               tokens_per_s=round(best["perf/actor_tokens_per_s"], 1), grad_norm=best["actor/grad_norm"],
               skipped_steps=best["actor/skipped_steps"])  # fmt: skip
    return out


def checkpointed_layers(module: torch.nn.Module) -> list[int]:
    """Per checkpointable stack (decoder layers, vision blocks): how many layers recompute now."""
    from vlrl.models.loading import checkpointable_stacks

    return [sum(bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers)
            for layers in checkpointable_stacks(module)]  # fmt: skip


def _set_policy(actor: Any, interval: int, budget: int) -> None:
    """Switch the built actor to checkpointing every `interval`-th layer and a `budget`-token micro-batch.

    The same call the loader makes for "every_k:K" (vlrl.models.loading.select_checkpointed_layers:
    transformers reads each layer's flag at every call), and the spec field `plan_micro_batches`
    reads, so the second policy needs no second 3B load (tens of seconds of the GPU budget)."""
    from dataclasses import replace

    from vlrl.models.loading import select_checkpointed_layers

    select_checkpointed_layers(actor.model.module, interval)
    actor.model.spec = replace(actor.model.spec, max_token_len_per_device=budget)


def check_update_mfu(ctx: Context, outcome: Outcome) -> None:
    from vlrl.models.processor import load_processor
    from vlrl.workers.from_config import build_actor

    size = update_sizes(ctx.small)
    model_dir = shaped_3b_model(ctx)
    config = _actor_config(model_dir, ctx, size.rows, max(size.responses),
                           **{"worker.actor.model.gradient_checkpointing_layers": "all",
                              "worker.actor.max_token_len_per_device": size.budget})  # fmt: skip
    batch = _rollout(ctx, model_dir, config, size.rows, size.image, size.responses)
    outcome.details["batch"] = _batch_info(batch)
    outcome.details["optimizer"] = config.worker.actor.optim.strategy
    with single_rank_world(ctx.device):
        _, processor = load_processor(model_dir)
        t = time.perf_counter()
        actor = build_actor(config, processor, ctx.device, model_path=model_dir)
        outcome.details["load_s"] = round(time.perf_counter() - t, 1)
        try:
            outcome.details["fused_adamw"] = bool(actor.optimizer.defaults.get("fused"))
            t = time.perf_counter()
            batch.old_log_probs = actor.compute_log_probs(batch)  # the step's old-policy pass, as in training
            outcome.details["old_log_probs_s"] = round(time.perf_counter() - t, 2)
            _measure_policies(ctx, actor, batch, size, outcome)
        finally:
            del actor
            free_device(ctx.device)
    if ctx.cuda:
        outcome.expect(outcome.details["fused_adamw"], "the actor's AdamW is not the fused kernel on CUDA")
    _goal_lines(ctx, outcome)


def _measure_policies(ctx: Context, actor: Any, batch: Any, size: UpdateSizes, outcome: Outcome) -> None:
    """'all' at the planned budget (half of it if that runs out of memory), then the lighter policy
    and 'all' again at the lighter policy's budget."""
    from vlrl.config.checks import gradient_checkpointing_interval

    full = None
    for budget in (size.budget, size.budget // 2):
        run = outcome.details["all" if budget == size.budget else f"all@{budget}"] = _try_run(
            ctx, actor, batch, "all", budget, size.timed
        )
        if "error" not in run:
            full = run
            break
    if full is None:
        outcome.failures.append(
            f"checkpointing 'all' ran out of memory at {size.budget} and {size.budget // 2} tokens"
        )
        return
    _expect_update(outcome, full)
    outcome.summary.update(token_budget=full["token_budget"], mfu_all=full["mfu"], tokens_per_s_all=full["tokens_per_s"],
                           peak_mib_all=full["memory"]["peak_allocated_mib"],
                           alloc_retries_all=full["memory"]["num_alloc_retries"])  # fmt: skip
    interval = gradient_checkpointing_interval(LIGHT_POLICY)
    budget, why = _light_policy_budget(ctx, actor.model.hf_config, full, full["token_budget"], interval)
    outcome.details["light_budget_reason"] = why
    if not (budget >= MIN_LIGHT_BUDGET or (ctx.small and budget > 0)):
        outcome.summary["light_policy"] = f"not run: {why}"
        return
    light = outcome.details[LIGHT_POLICY] = _try_run(ctx, actor, batch, LIGHT_POLICY, budget, size.timed)
    memory = light.get("memory", {})
    outcome.summary.update(light_policy=LIGHT_POLICY, light_budget=budget, mfu_light=light.get("mfu"),
                           peak_mib_light=memory.get("peak_allocated_mib"),
                           alloc_retries_light=memory.get("num_alloc_retries"))  # fmt: skip
    if "error" not in light:
        _expect_update(outcome, light)
        outcome.expect(light["checkpointed_layers"] < full["checkpointed_layers"],
                       f"{LIGHT_POLICY} recomputes as many layers as 'all': {light['checkpointed_layers']}")  # fmt: skip
    if budget < full["token_budget"]:  # "all" at the lighter policy's budget: the recompute's cost alone
        same = outcome.details[f"all@{budget}"] = _try_run(ctx, actor, batch, "all", budget, size.timed)
        outcome.summary[f"mfu_all_at_{budget}"] = same.get("mfu")


def _try_run(ctx: Context, actor: Any, batch: Any, policy: str, budget: int, timed: int) -> dict[str, Any]:
    """`_timed_updates` under `policy` at `budget`; running out of memory is a result (budgets are
    estimates), not a failure of the check."""
    from vlrl.config.checks import gradient_checkpointing_interval

    _set_policy(actor, gradient_checkpointing_interval(policy), budget)
    head = {"policy": policy, "token_budget": budget}
    try:
        return {**head, **_timed_updates(ctx, actor, batch, timed)}
    except torch.cuda.OutOfMemoryError as err:  # torch/cuda/__init__.py (torch >= 1.13)
        actor.optimizer.zero_grad(set_to_none=True)
        free_device(ctx.device)
        return {**head, "error": f"OutOfMemoryError: {str(err)[:300]}"}


def _light_policy_budget(
    ctx: Context, hf_config: Any, full: dict[str, Any], cap: int, interval: int
) -> tuple[int, str]:
    """The lighter policy's token budget: what its kept activations are estimated to fit in the
    memory the "all" run left unused (total - its peak - a 4 GiB margin). CPU: the same budget."""
    total = device_total_bytes(ctx.device)
    if total is None:
        return max(
            cap // 2, 1
        ), "CPU: half the budget of 'all' (no memory limit; runs the comparison path too)"
    text = getattr(hf_config, "text_config", None) or hf_config
    kept = kept_layers(int(text.num_hidden_layers), interval)
    per_token = layer_activation_bytes_per_token(hf_config)
    free = total - int(full["memory"]["peak_allocated_mib"] * 2**20) - MARGIN_BYTES
    budget = light_budget(max(free, 0), per_token, kept, cap)
    why = (f"{kept} layers keep ~{per_token / 1024:.0f} KiB/token each; {max(free, 0) / 2**30:.1f} GiB free after "
           f"'all' (total - peak - 4 GiB) -> budget {budget}")  # fmt: skip
    return budget, why


def _expect_update(outcome: Outcome, run: dict[str, Any]) -> None:
    name = run["policy"]
    grad = run["grad_norm"]
    outcome.expect(grad == grad, f"{name}: NaN grad norm")
    outcome.expect(run["skipped_steps"] == 0, f"{name}: the optimizer skipped a step (non-finite gradient)")


def _goal_lines(ctx: Context, outcome: Outcome) -> None:
    """The issue's goal lines, in words, for the report (a target missed is not a failure)."""
    lines = []
    for run in outcome.details.values():
        if not (isinstance(run, dict) and "policy" in run and "token_budget" in run):
            continue
        label = f"checkpointing {run['policy']!r}, {run['token_budget']}-token micro-batches"
        if "error" in run:
            lines.append(f"update ({label}): did not run: {run['error'][:120]}")
            continue
        mfu, mem = run["mfu"], run["memory"]
        met = "MET" if isinstance(mfu, float) and mfu >= MFU_GOAL else "NOT met"
        line = f"update MFU >= 35% ({label}): {met} ({100 * mfu:.1f}%)"
        if mem.get("peak_allocated_mib") is not None:
            line += f"; peak {mem['peak_allocated_mib'] / 1024:.1f} GiB allocated, {mem['num_alloc_retries']} allocator retries"
        lines.append(line)
    if ctx.cuda:
        mfu_all = outcome.summary.get("mfu_all")
        outcome.summary["mfu_goal_35pct_met"] = isinstance(mfu_all, float) and mfu_all >= MFU_GOAL
    outcome.details["goal_lines"] = lines


# ------------------------------------------------------------------------------ log-prob memory
def check_logprob_memory(ctx: Context, outcome: Outcome) -> None:
    from transformers import AutoConfig

    from vlrl.models.processor import load_processor
    from vlrl.workers.from_config import build_actor

    size = logprob_sizes(ctx.small)
    model_dir = shaped_3b_model(ctx)
    vocab = int(AutoConfig.from_pretrained(model_dir).text_config.vocab_size)
    # default micro-batch for experience (16 rows) x the widest row: the whole batch is one micro-batch
    config = _actor_config(model_dir, ctx, size.rows, size.response)
    batch = _rollout(ctx, model_dir, config, size.rows, size.image, [size.response])
    info = outcome.details["batch"] = _batch_info(batch)
    with single_rank_world(ctx.device):
        _, processor = load_processor(model_dir)
        actor = build_actor(config, processor, ctx.device, model_path=model_dir)
        try:
            micro = actor.model.plan_micro_batches(
                batch, config.worker.actor.micro_batch_size_per_device_for_experience
            )
            resident = start_phase(ctx.device)
            loaded_mib = _allocated_mib(ctx.device)
            t = time.perf_counter()
            log_probs = actor.compute_log_probs(batch)
            seconds = time.perf_counter() - t
            mem = outcome.details["memory"] = end_phase(ctx.device, resident)
        finally:
            del actor
            free_device(ctx.device)
    widest_mb = max(sum(int(batch.attention_mask[r].sum()) for r in rows) for rows in micro if rows)
    estimate = full_logits_bytes(info["response_tokens"], vocab)
    outcome.details.update(micro_batches=[len(r) for r in micro], seconds=round(seconds, 2), vocab=vocab,
                           full_logits_estimate_mib=round(estimate / 2**20, 1),
                           largest_micro_batch_tokens=widest_mb)  # fmt: skip
    outcome.summary.update(rows=info["rows"], response_tokens=info["response_tokens"], vocab=vocab,
                           micro_batches=len(micro), full_logits_mib=round(estimate / 2**20, 1))  # fmt: skip
    outcome.expect(bool(torch.isfinite(log_probs[batch.response_mask.bool()]).all()), "non-finite log-probs")
    if mem.get("peak_allocated_mib") is not None:
        above = mem["peak_allocated_mib"] - loaded_mib
        outcome.summary.update(peak_mib=mem["peak_allocated_mib"], pass_extra_mib=round(above, 1),
                               alloc_retries=mem["num_alloc_retries"])  # fmt: skip
        # the chunked head must stay well under what the full logits alone would take
        outcome.expect(above * 2**20 < 0.5 * estimate,
                       f"the log-prob pass used {above / 1024:.1f} GiB above the loaded model, not far below "
                       f"the {estimate / 2**30:.1f} GiB of full bf16 logits")  # fmt: skip
    outcome.details["goal_lines"] = _logprob_lines(outcome, loaded_mib)


def _allocated_mib(device: torch.device) -> float:
    return round(torch.cuda.memory_allocated(device) / 2**20, 1) if device.type == "cuda" else 0.0


def _logprob_lines(outcome: Outcome, loaded_mib: float) -> list[str]:
    s, d = outcome.summary, outcome.details
    head = (f"log-prob pass, {s['rows']} rows x {d['batch']['widest']} tokens wide ({s['response_tokens']} response "
            f"tokens, vocab {s['vocab']}, {s['micro_batches']} micro-batch(es)): full bf16 logits would take "
            f"{s['full_logits_mib'] / 1024:.2f} GiB (computed, not run)")  # fmt: skip
    if "peak_mib" not in s:
        return [head + "; measured peak: CUDA only"]
    return [head + f"; measured peak {s['peak_mib'] / 1024:.2f} GiB = {loaded_mib / 1024:.2f} GiB model + "
            f"{s['pass_extra_mib'] / 1024:.2f} GiB "
            f"for the pass, {s['alloc_retries']} allocator retries"]  # fmt: skip
