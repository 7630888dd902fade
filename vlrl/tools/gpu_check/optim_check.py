"""Check: optimizer step time at Qwen2.5-VL-3B's parameter shapes, as FSDP2 holds them (DTensors).

torch's AdamW (its default multi-tensor path on CUDA), vlrl's `AdamWBf16` (bf16 moments, foreach
kernels on the local shards) and the gradient clip of `clip_and_step` on the same parameters. The
parameters are the model's shapes in order until `MAX_ELEMENTS` (the vision tower and the first
decoder layers: hundreds of tensors, the per-tensor overhead this measures), fp32 on a one-rank mesh.
"""

from __future__ import annotations

import time

import torch

from vlrl.tools.gpu_check.context import Context, memory, single_rank_world, sync
from vlrl.tools.gpu_check.report import Outcome

MAX_ELEMENTS = 2_000_000_000  # ~8 GB of fp32 parameters, as much again in gradients
TIMED_STEPS = 3


def parameter_shapes(small: bool) -> list[torch.Size]:
    """Parameter shapes of the 3B-shaped model (or its small stand-in), built on the meta device."""
    from transformers import AutoModelForImageTextToText

    from vlrl.models.tiny import SIZES, _token_ids, build_tokenizer
    from vlrl.tools.gpu_check.qwen3b_check import qwen25_vl_3b_config

    config = qwen25_vl_3b_config(_token_ids(build_tokenizer(SIZES["tiny"].vocab)), small)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return [p.shape for p in model.parameters()]


def _parameters(shapes: list[torch.Size], device: torch.device) -> list[torch.nn.Parameter]:
    """fp32 DTensor parameters (one-rank mesh, as FSDP2 shards them) with gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (1,))
    params, total = [], 0
    for shape in shapes:
        if total + shape.numel() > MAX_ELEMENTS:
            break
        total += shape.numel()
        p = torch.nn.Parameter(distribute_tensor(torch.randn(shape, device=device) * 0.02, mesh, [Shard(0)]))
        p.grad = p.detach() * 1e-3
        params.append(p)
    return params


def _time(step, device: torch.device) -> float:
    """Milliseconds per call of `step()`: one warm-up call (state allocation), then the mean of a few."""
    step()
    sync(device)
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        step()
    sync(device)
    return round(1000 * (time.perf_counter() - start) / TIMED_STEPS, 2)


def check_optimizer(ctx: Context, outcome: Outcome) -> None:
    from vlrl.workers.optim import AdamWBf16, global_grad_norm, local

    shapes = parameter_shapes(ctx.small)
    with single_rank_world(ctx.device):
        params = _parameters(shapes, ctx.device)
        outcome.details.update(tensors=len(params), elements=sum(p.numel() for p in params),
                               memory_params=memory(ctx.device))  # fmt: skip
        times = {}
        for name, cls in (("adamw", torch.optim.AdamW), ("adamw_bf16", AdamWBf16)):
            opt = cls(params, lr=1e-6, weight_decay=0.01)
            times[f"{name}_ms"] = _time(opt.step, ctx.device)
            outcome.details[f"memory_{name}"] = memory(ctx.device)
            del opt  # its states
        grads = [local(p.grad) for p in params if p.grad is not None]
        times["grad_norm_ms"] = _time(lambda: global_grad_norm(params), ctx.device)
        times["clip_ms"] = _time(lambda: torch._foreach_mul_(grads, 0.999), ctx.device)
        finite = all(bool(torch.isfinite(local(p)).all()) for p in params[:8])
    outcome.summary.update(times, tensors=len(params), params_b=round(outcome.details["elements"] / 1e9, 2))
    outcome.expect(finite, "non-finite parameters after the optimizer steps")
    if ctx.cuda:  # bf16 moments cost conversions; many times AdamW's time means a per-tensor loop is back
        bound = 3 * times["adamw_ms"] + 5
        outcome.expect(times["adamw_bf16_ms"] <= bound,
                       f"AdamWBf16 step {times['adamw_bf16_ms']} ms > 3x AdamW's ({times['adamw_ms']} ms) + 5")  # fmt: skip
