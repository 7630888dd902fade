"""Optimizer step time on FSDP2-style DTensor parameters: foreach kernels vs a per-parameter loop.

    python benchmarks/bench_optimizer.py                 # CUDA: Qwen2.5-VL-3B shapes (first 2e9 elements)
    .venv/bin/python benchmarks/bench_optimizer.py       # CPU: the small stand-in shapes

Rows: torch's AdamW; vlrl's `AdamWBf16` (foreach on local shards, chunked); the same update
written as a loop over parameters with DTensor ops (how `AdamWBf16` was written before: ~10
DTensor ops per parameter); the grad clip as one foreach multiply vs a loop of `mul_`. Each row is
one warm-up call and the mean of three; all rows run in one process on the same parameters.
"""

from __future__ import annotations

import argparse

import torch

from vlrl.tools.gpu_check.context import single_rank_world
from vlrl.tools.gpu_check.optim_check import _parameters, _time, parameter_shapes
from vlrl.workers.optim import AdamWBf16, local


class LoopAdamWBf16(torch.optim.Optimizer):
    """The baseline: AdamW with bf16 moments, one parameter at a time through DTensor ops."""

    def __init__(
        self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                t = float(state["step"])
                grad = p.grad.float()
                m = state["exp_avg"].float().mul_(beta1).add_(grad, alpha=1 - beta1)
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                update = (m / (1 - beta1**t)).div_((v / (1 - beta2**t)).sqrt_().add_(group["eps"]))
                update.add_(p.float(), alpha=group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = parameter_shapes(small=device.type != "cuda")
    rows = []
    with single_rank_world(device):
        params = _parameters(shapes, device)
        for name, cls in (("torch AdamW", torch.optim.AdamW), ("AdamWBf16 (foreach)", AdamWBf16),
                          ("AdamWBf16 as a per-parameter loop", LoopAdamWBf16)):  # fmt: skip
            opt = cls(params, lr=1e-6, weight_decay=0.01)
            rows.append((name, _time(opt.step, device)))
            del opt
        grads = [local(p.grad) for p in params if p.grad is not None]
        rows.append(("clip: one foreach multiply", _time(lambda: torch._foreach_mul_(grads, 0.999), device)))
        dgrads = [p.grad for p in params if p.grad is not None]
        rows.append(("clip: a mul_ per DTensor grad", _time(lambda: [g.mul_(0.999) for g in dgrads], device)))
    elements = sum(p.numel() for p in params)
    print(f"{len(params)} parameters, {elements / 1e9:.2f} B elements, {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'})")  # fmt: skip
    print(f"{'step':<36} {'ms':>10}")
    for name, ms in rows:
        print(f"{name:<36} {ms:>10.2f}")


if __name__ == "__main__":
    main()
