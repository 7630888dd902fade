"""Optimizer, learning-rate schedule and a guarded optimizer step (clip, skip non-finite).

- `adamw`: torch AdamW (moments in the parameters' dtype).
- `adamw_bf16`: `AdamWBf16`, AdamW whose two moments are stored in bf16 (half the state memory);
  the update itself is computed in fp32.
- Schedule: linear warm-up over `lr_warmup_steps` trainer steps (or `lr_warmup_ratio * total_steps`) from 0 to
  `lr`, then constant, or cosine down to `min_lr_ratio * lr` at `total_steps`.
- `clip_and_step`: the global grad norm (across ranks: FSDP2 grads are DTensors whose norms are
  reduced by `full_tensor()`), clipping to `max_grad_norm`, and a skipped step (grads zeroed, no
  update) when that norm is not finite. Every rank sees the same global norm, so all skip together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from vlrl.config import OptimConfig

STRATEGIES = ("adamw", "adamw_bf16")
SCHEDULES = ("constant", "cosine")


# fp32 temporaries of one AdamWBf16 chunk (grads, both moments, the update): at most ~4 x 256 MiB
CHUNK_ELEMENTS = 1 << 26


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage: in-place writes reach the DTensor), else `t`.

    Elementwise optimizer math needs no communication, and plain-tensor foreach kernels skip
    DTensor's per-op dispatch (~10 ops per parameter, ~700 parameters at 7B)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _chunks(params: list[torch.nn.Parameter], limit: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive runs of `params` of at most `limit` local elements each (a larger one alone)."""
    out: list[list[torch.nn.Parameter]] = []
    size = limit
    for p in params:
        n = local(p).numel()
        if size + n > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return out


class AdamWBf16(torch.optim.Optimizer):
    """AdamW with bf16 first/second moments; fp32 arithmetic for the update (decoupled decay).

    The update runs as foreach (multi-tensor) kernels on each rank's local shards, in chunks of
    `CHUNK_ELEMENTS` so the fp32 temporaries stay small next to the bf16 states they save."""

    def __init__(
        self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0
    ):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
            for chunk in _chunks([p for p in params if local(p).numel()], CHUNK_ELEMENTS):
                self._update(chunk, group)
        return loss

    def _update(self, params: list[torch.nn.Parameter], group: dict[str, Any]) -> None:
        """One AdamW step of `params` (local shards, one device): m, v in fp32, stored back in bf16."""
        beta1, beta2 = group["betas"]
        lr, eps, decay = float(group["lr"]), group["eps"], group["weight_decay"]
        states = [self.state[p] for p in params]
        steps = [float(s["step"]) for s in states]  # CPU scalars: no device sync
        weights = [local(p) for p in params]
        grads = [local(p.grad).float() for p in params if p.grad is not None]  # (all have one)
        m = [local(s["exp_avg"]).float() for s in states]
        v = [local(s["exp_avg_sq"]).float() for s in states]
        torch._foreach_mul_(m, beta1)
        torch._foreach_add_(m, grads, alpha=1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        torch._foreach_copy_([local(s["exp_avg"]) for s in states], m)
        torch._foreach_copy_([local(s["exp_avg_sq"]) for s in states], v)
        denom = torch._foreach_div(v, [1 - beta2**t for t in steps])
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(m, [1 - beta1**t for t in steps])
        torch._foreach_div_(update, denom)
        if decay:
            torch._foreach_add_(update, [w.float() for w in weights], alpha=decay)
        torch._foreach_add_(weights, [u.to(w.dtype) for u, w in zip(update, weights)], alpha=-lr)


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (`optim.strategy=adamw`) or AdamWBf16 (`adamw_bf16`) over `params`."""
    params = list(params)
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": tuple(cfg.betas), "weight_decay": cfg.weight_decay}
    if cfg.strategy == "adamw":
        return torch.optim.AdamW(params, **kwargs)
    if cfg.strategy == "adamw_bf16":
        return AdamWBf16(params, **kwargs)
    raise ValueError(f"unknown optim.strategy {cfg.strategy!r}; valid: {list(STRATEGIES)}")


def warmup_steps(cfg: OptimConfig, total_steps: int, per_trainer_step: int = 1) -> int:
    """Warm-up length in optimizer steps: `lr_warmup_steps` (counted in trainer steps, each
    `per_trainer_step` optimizer steps) when set, else `lr_warmup_ratio * total_steps` (rounded down)."""
    if cfg.lr_warmup_steps is not None and cfg.lr_warmup_steps >= 0:
        return int(cfg.lr_warmup_steps) * per_trainer_step
    return int(cfg.lr_warmup_ratio * total_steps)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int, per_trainer_step: int = 1) -> float:
    """Multiplier of `lr` at optimizer step `step` (0-based); `total_steps` counts optimizer steps."""
    warm = warmup_steps(cfg, total_steps, per_trainer_step)
    if step < warm:
        return (step + 1) / warm
    if cfg.lr_scheduler_type == "constant":
        return 1.0
    if cfg.lr_scheduler_type == "cosine":
        span = max(total_steps - warm, 1)
        progress = min((step - warm) / span, 1.0)
        floor = cfg.min_lr_ratio or 0.0
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_scheduler_type {cfg.lr_scheduler_type!r}; valid: {list(SCHEDULES)}")


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int, per_trainer_step: int = 1
) -> LambdaLR:
    """A LambdaLR stepping once per optimizer step; `total_steps` counts optimizer steps and each
    trainer step makes `per_trainer_step` of them (for `lr_warmup_steps`)."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps, per_trainer_step))


def global_grad_norm(params: list[torch.nn.Parameter]) -> float:
    """L2 norm of all gradients over all ranks (DTensor grads are reduced by `full_tensor`)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    return float(total)


def any_nonfinite(tensors: list[torch.Tensor]) -> bool:
    """Whether any of the tensors holds inf or nan: one fused max-abs per tensor (inf-norm: finite
    exactly when every element is, and unlike the 2-norm it cannot overflow), then one reduction."""
    # torch 2.13 refuses the inf-norm of an empty tensor (torch/_meta_registrations.py
    # `meta_foreach_norm`; a rank's FSDP shard can be empty), on CPU and CUDA alike; on CUDA the
    # fused kernel handles bf16 and returns one 0-dim tensor per input, and `bool` below is the one sync.
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return False
    norms = torch._foreach_norm(tensors, ord=float("inf"))
    return not bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


def clip_and_step(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_grad_norm: float
) -> tuple[float, bool]:
    """Clip to `max_grad_norm` (<= 0: no clipping) and step; returns (grad norm before clipping, skipped).

    A non-finite norm skips the update: gradients are zeroed and the parameters stay unchanged.
    """
    norm = global_grad_norm(params)
    skipped = not math.isfinite(norm)
    if not skipped:
        if max_grad_norm > 0 and norm > max_grad_norm:
            coef = max_grad_norm / (norm + 1e-6)
            grads = [local(p.grad) for p in params if p.grad is not None]
            torch._foreach_mul_([g for g in grads if g.numel()], coef)  # one multi-tensor kernel
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, skipped
