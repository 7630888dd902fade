"""Check c: packed ("padding-free") vs padded log-probs and gradients in bf16, and fp32 on the
device vs the same computation on the CPU.

Each variant is a real `Actor` (FSDP2, one rank) on the tiny Qwen2.5-VL, fed the same batch of
image and text prompts with responses of different lengths. The loss whose gradient is compared
is sum(w * log_probs) with fixed random weights w on the response tokens.
- bf16 (mixed precision on CUDA): packed and padded must agree to bf16 accuracy, and the packed
  error against the fp32 result must not exceed twice the padded one;
- fp32 on the device vs fp32 on the CPU: agree to 1e-3 (TF32 off for this comparison).
On CPU (`--device cpu`) both variants run in fp32 and must agree to 1e-4.

`check_moe_packed_vs_padded` runs the same comparisons on the tiny Qwen3-VL-MoE (4 experts, top-2;
transformers' default `grouped_mm` experts kernel), which CPU tests cannot cover on CUDA: the
bf16 grouped GEMM of the experts, and top-k routing under bf16 noise (a token whose two best
experts are near a tie may switch expert between packed and padded; the bounds still apply).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from vlrl.tools.gpu_check.context import Context, single_rank_world
from vlrl.tools.gpu_check.inputs import actor_log_prob_grads, make_config, prompt_batch, random_rollout
from vlrl.tools.gpu_check.report import Outcome


def _grad_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all parameters (relative error of the whole gradient)."""
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in b)
    den = sum(float(b[k].pow(2).sum()) for k in b)
    return (num / max(den, 1e-30)) ** 0.5


def _lp_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(max, mean) |a - b| over the response tokens."""
    diff = (a - b)[mask.bool()].abs()
    return float(diff.max()), float(diff.mean())


def _variant(model_dir: str, device: torch.device, batch, weights, padding_free: bool, compute: str):
    """(log-probs, grads) of an Actor with `padding_free` computing in `compute` (bf16 | fp32)."""
    from vlrl.models.processor import load_processor
    from vlrl.workers.from_config import build_actor

    config = make_config(
        model_dir, device,
        **{"worker.actor.padding_free": padding_free, "worker.actor.fsdp.mp_param_dtype": compute},
    )  # fmt: skip
    _, processor = load_processor(model_dir)
    actor = build_actor(config, processor, device, model_path=model_dir)
    try:
        return actor_log_prob_grads(actor.model, batch, weights)
    finally:
        del actor


@contextlib.contextmanager
def _no_tf32() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def check_packed_vs_padded(ctx: Context, outcome: Outcome) -> None:
    _packed_vs_padded(ctx, outcome, "qwen2_5_vl")


def check_moe_packed_vs_padded(ctx: Context, outcome: Outcome) -> None:
    from transformers import AutoConfig

    model_dir = ctx.tiny_model("qwen3_vl_moe")
    text = AutoConfig.from_pretrained(model_dir).text_config
    outcome.details["experts"] = {"num_experts": text.num_experts, "top_k": text.num_experts_per_tok}
    _packed_vs_padded(ctx, outcome, "qwen3_vl_moe")


def _packed_vs_padded(ctx: Context, outcome: Outcome, arch: str) -> None:
    model_dir = ctx.tiny_model(arch)
    config = make_config(model_dir, ctx.device)
    prompts = prompt_batch(model_dir, config.data, 4, 56, ctx.seed)
    batch = random_rollout(model_dir, prompts, 2, [3, 16, 9, 1, 12], vocab_limit=500, seed=ctx.seed)
    mask = batch.response_mask
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(ctx.seed)) * mask
    outcome.details["batch"] = {"rows": len(batch), "response_tokens": int(mask.sum()),
                                "lengths": batch.attention_mask.sum(-1).tolist()}  # fmt: skip
    cpu = torch.device("cpu")
    variants = [("cpu_packed", cpu, True, "fp32")]
    if ctx.cuda:
        variants += [("bf16_packed", ctx.device, True, "bf16"), ("bf16_padded", ctx.device, False, "bf16"),
                     ("fp32_packed", ctx.device, True, "fp32")]  # fmt: skip
    else:
        variants.append(("cpu_padded", cpu, False, "fp32"))
    results: dict[str, Any] = {}
    with single_rank_world(ctx.device, cpu_too=ctx.cuda):
        for name, device, packed, compute in variants:
            try:  # one failing variant (e.g. a kernel without fp32) must not hide the others
                with _no_tf32():  # fp32 means fp32 (TF32 matmuls/convs would differ by ~1e-3)
                    results[name] = _variant(model_dir, device, batch, weights, packed, compute)
            except Exception as err:  # noqa: BLE001 (recorded as this check's failure)
                outcome.details.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"
                outcome.details.setdefault("tracebacks", {})[name] = traceback.format_exc()[-4000:]
                outcome.failures.append(f"{name}: raised {type(err).__name__}: {str(err)[:200]}")
    for name, (lp, _) in results.items():
        outcome.expect(bool(torch.isfinite(lp).all()), f"{name}: non-finite log-probs")
    if ctx.cuda:
        _compare_gpu(outcome, results, mask)
    elif {"cpu_packed", "cpu_padded"} <= set(results):
        lp_max, _ = _lp_gap(results["cpu_packed"][0], results["cpu_padded"][0], mask)
        grad = _grad_gap(results["cpu_packed"][1], results["cpu_padded"][1])
        outcome.summary.update(fp32_lp_max=lp_max, fp32_grad_rel=grad)
        outcome.expect(lp_max <= 1e-4, f"fp32 packed vs padded log-probs differ by {lp_max:.3g}")
        outcome.expect(grad <= 1e-4, f"fp32 packed vs padded gradients differ by {grad:.3g} (relative)")


def _compare_gpu(outcome: Outcome, results: dict[str, Any], mask: torch.Tensor) -> None:
    """Every comparison whose variants ran (a variant that raised is already a failure)."""
    have = set(results)
    if {"bf16_packed", "bf16_padded"} <= have:
        (pk_lp, pk_g), (pd_lp, pd_g) = results["bf16_packed"], results["bf16_padded"]
        lp_max, lp_mean = _lp_gap(pk_lp, pd_lp, mask)
        grad = _grad_gap(pk_g, pd_g)
        outcome.summary.update(bf16_lp_max=lp_max, bf16_lp_mean=lp_mean, bf16_grad_rel=grad)
        outcome.expect(lp_mean <= 0.02 and lp_max <= 0.25,
                       f"bf16 packed vs padded log-probs: max {lp_max:.3g}, mean {lp_mean:.3g}")  # fmt: skip
        outcome.expect(grad <= 0.05, f"bf16 packed vs padded gradients differ by {grad:.3g} (relative)")
    if {"bf16_packed", "bf16_padded", "fp32_packed"} <= have:
        (pk_lp, pk_g), (pd_lp, pd_g) = results["bf16_packed"], results["bf16_padded"]
        f_lp, f_g = results["fp32_packed"]
        errors = {"packed_lp_mean": _lp_gap(pk_lp, f_lp, mask)[1], "padded_lp_mean": _lp_gap(pd_lp, f_lp, mask)[1],
                  "packed_grad_rel": _grad_gap(pk_g, f_g), "padded_grad_rel": _grad_gap(pd_g, f_g)}  # fmt: skip
        outcome.details["bf16_vs_fp32"] = errors
        for kind in ("lp_mean", "grad_rel"):
            packed, padded = errors[f"packed_{kind}"], errors[f"padded_{kind}"]
            outcome.expect(packed <= 2 * padded + 1e-3,
                           f"bf16 packed less accurate than padded ({kind} vs fp32): {packed:.3g} vs {padded:.3g}")  # fmt: skip
    if {"fp32_packed", "cpu_packed"} <= have:
        (f_lp, f_g), (c_lp, c_g) = results["fp32_packed"], results["cpu_packed"]
        fp32_lp, _ = _lp_gap(f_lp, c_lp, mask)
        fp32_grad = _grad_gap(f_g, c_g)
        outcome.summary.update(fp32_vs_cpu_lp=fp32_lp, fp32_vs_cpu_grad_rel=fp32_grad)
        outcome.expect(fp32_lp <= 1e-3, f"fp32 on the GPU vs the CPU: log-probs differ by {fp32_lp:.3g}")
        outcome.expect(
            fp32_grad <= 1e-3, f"fp32 on the GPU vs the CPU: gradients differ by {fp32_grad:.3g} (relative)"
        )
