"""Optimizer, learning-rate schedule and a guarded optimizer step (clip, skip non-finite).

- `adamw`: torch AdamW (moments in the parameters' dtype); its fused kernel (`fused=True`) when every
  parameter is on an accelerator that has one (CUDA), else torch's default loop (CPU, unchanged).
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
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

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


def adamw_implementation(params: Iterable[torch.Tensor]) -> str:
    """The AdamW implementation for `params`: "fused" (one `torch._fused_adamw_` kernel per device
    and dtype) when every parameter is a floating-point tensor on an accelerator with fused
    optimizer kernels, else "default" (torch's own choice: the per-parameter loop on CPU, today's
    numerics).

    Devices: torch 2.13 torch/utils/_foreach_utils.py `_get_fused_kernels_supported_devices` lists
    cpu too, but CPU keeps the default loop on purpose: fused rounds differently, and CPU runs (the
    quickstart, the tests) would change their numbers. DTensor parameters (FSDP2) are fine: DTensor
    registers `aten._fused_adamw_` as a pointwise op on the local shards (torch/distributed/tensor/
    _ops/_pointwise_ops.py; the 0-dim `step` counters may live off the params' mesh, see
    _ops/utils.py "Multi-mesh args"). torch's own default would not pick fused, nor even foreach,
    for them: `_default_to_fused_or_foreach` (torch/optim/optimizer.py) accepts plain tensors only."""
    params = list(params)
    ok = all(fused_adamw_supported(p.device, p.dtype) for p in params)
    return "fused" if params and ok else "default"


def fused_adamw_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether vlrl runs AdamW fused for a parameter on `device` of `dtype` (CPU never: see
    `adamw_implementation`)."""
    accelerators = set(_get_fused_kernels_supported_devices()) - {"cpu"}
    return torch.device(device).type in accelerators and dtype.is_floating_point


def _keep_implementation(optimizer: torch.optim.Optimizer) -> None:
    """Make a loaded AdamW state run with the implementation this run chose (a load-state-dict
    post-hook; checkpoints resume across the two, e.g. written on GPU (fused), resumed on CPU).

    torch's loader takes every hyper-parameter but `params` from the SAVED groups, `fused` and
    `foreach` included, and places each `step` counter by the saved group's `fused` flag (torch
    2.13 torch/optim/optimizer.py `load_state_dict` / `_process_value_according_to_param_policy`).
    So the flags chosen at build time (`optimizer.defaults`) are put back, and `step` moves to
    where that implementation reads it: the parameter's device in float32 for fused, the host for
    the loop (which reads it with `.item()`: a device sync per parameter if it stayed on a GPU).
    The state keys are the same either way (step, exp_avg, exp_avg_sq)."""
    fused = bool(optimizer.defaults.get("fused"))
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = optimizer.defaults["fused"], optimizer.defaults["foreach"]
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if not isinstance(step, torch.Tensor):
                continue
            device = p.device if fused else torch.device("cpu")
            if step.device != device:
                optimizer.state[p]["step"] = step.to(device=device, dtype=torch.float32)


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (`optim.strategy=adamw`; fused on GPU, see `adamw_implementation`) or AdamWBf16
    (`adamw_bf16`) over `params`."""
    params = list(params)
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": tuple(cfg.betas), "weight_decay": cfg.weight_decay}
    if cfg.strategy == "adamw":
        fused = adamw_implementation(params) == "fused"
        optimizer = torch.optim.AdamW(params, **kwargs, fused=fused or None)
        optimizer.register_load_state_dict_post_hook(_keep_implementation)
        return optimizer
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


def nonfinite_screen(tensors: list[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """A 0-dim float32 flag, without a host sync: 0.0 when every tensor's 2-norm is finite, which
    proves every element finite (an inf or nan element makes the sum of squares inf or nan, and
    nothing turns those finite again), 1.0 otherwise: a non-finite element, or a 2-norm too large
    for float32 (|x| ~ 1e19 and up), which only `any_nonfinite`'s exact check tells apart.

    Per dtype (one, usually): one `_foreach_norm` (multi-tensor kernels on CUDA), one `stack` of
    its 0-dim results and one max, instead of a cast kernel per tensor. The 2-norm because on CPU it
    is a vectorized reduction while torch 2.13's CPU inf-norm is ~50x slower (benchmarks/
    bench_nonfinite_check.py). `device`: where the flag goes when there are no tensors (an empty shard)."""
    worst = _worst_norm(tensors, 2.0)
    if worst is None:
        return torch.zeros((), dtype=torch.float32, device=device)
    return (~torch.isfinite(worst)).float()


def _worst_norm(tensors: list[torch.Tensor], ord: float) -> torch.Tensor | None:
    """The largest `ord`-norm of the non-empty tensors as a 0-dim float32 tensor (nan if any norm is
    nan: max propagates it), None without any. Grouped by dtype: `stack` needs one dtype, and
    `_foreach_norm` returns each norm in its tensor's dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    worst = [torch.stack(list(torch._foreach_norm(group, ord))).max().float() for group in by_dtype.values()]
    if not worst:
        return None
    return worst[0] if len(worst) == 1 else torch.stack(worst).max()


def any_nonfinite(tensors: list[torch.Tensor]) -> bool:
    """Whether any of the tensors holds inf or nan (one host sync when they are all finite).

    `nonfinite_screen` first; only when it flags (non-finite, or a 2-norm that overflowed) the exact
    check: a fused max-abs per tensor (inf-norm: finite exactly when every element is, and it
    cannot overflow)."""
    if not bool(nonfinite_screen(tensors)):
        return False
    # torch 2.13 refuses the inf-norm of an empty tensor (torch/_meta_registrations.py
    # `meta_foreach_norm`; a rank's FSDP shard can be empty), on CPU and CUDA alike: `_worst_norm`
    # leaves them out.
    worst = _worst_norm(tensors, float("inf"))
    return worst is not None and not bool(torch.isfinite(worst))


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
