"""Cost of the actor's non-finite weight check (`Actor.weights_finite`, after every optimizer step
and before every checkpoint save) over ~100M parameters, on this machine's CPU.

    .venv/bin/python benchmarks/bench_nonfinite_check.py [--params 100e6] [--repeats 5]

Two layouts of the same parameter count: a Qwen-like list of matrices (few large tensors) and 700
tensors (about what one rank holds for a 7B model: many small shards). Checks compared, all on
finite weights (the common case), best of `--repeats`:

- per-tensor sync: `isfinite(t).all()` read per tensor (a host sync each), the naive way;
- inf-norm (before): `_foreach_norm(inf)`, a cast per norm, `stack`, `isfinite().all()`, one read
  (vlrl before this benchmark);
- 2-norm screen (now): `vlrl.workers.optim.any_nonfinite`, whose screen takes one
  `_foreach_norm(2)` per dtype, `stack`, `max` and one read; the exact inf-norm runs only if the
  screen flags (not here).

On GPU all three read the weights once at memory bandwidth, and what differs is kernel launches
(before: one cast per tensor) and syncs (before, with several ranks: one read of the local flag,
then one of the all-reduce; now one); those are not measured here (no GPU on this machine).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from vlrl.workers.optim import any_nonfinite


def inf_norm_check(tensors: list[torch.Tensor]) -> bool:
    """The check as it was: fused inf-norm per tensor, cast each, one reduction, one read."""
    tensors = [t for t in tensors if t.numel()]
    norms = torch._foreach_norm(tensors, ord=float("inf"))
    return not bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


def per_tensor_check(tensors: list[torch.Tensor]) -> bool:
    return any(not bool(torch.isfinite(t).all()) for t in tensors)


def qwen_like(total: float) -> list[torch.Tensor]:
    """Layers of a Qwen-like decoder (hidden 1024, MLP 2816, GQA 4:1) and an embedding, ~`total`."""
    h, inter, vocab = 1024, 2816, 16384
    layer = [(h, h), (h // 4, h), (h // 4, h), (h, h), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    per_layer = sum(torch.Size(s).numel() for s in layer)
    layers = max(int((total - vocab * h) // per_layer), 1)
    return [torch.randn(vocab, h)] + [torch.randn(s) for _ in range(layers) for s in layer]


def many_small(total: float, count: int = 700) -> list[torch.Tensor]:
    return [torch.randn(int(total // count)) for _ in range(count)]


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    checks: dict[str, Callable[[list[torch.Tensor]], bool]] = {
        "per-tensor sync": per_tensor_check,
        "inf-norm (before)": inf_norm_check,
        "2-norm screen (now)": any_nonfinite,
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, fp32, best of {args.repeats}\n")
    print(f"| layout | tensors | parameters | {' | '.join(f'{name} ms' for name in checks)} |")
    print("| --- | ---: | ---: |" + " ---: |" * len(checks))
    for layout, tensors in (("Qwen-like", qwen_like(args.params)), ("700 equal", many_small(args.params))):
        n = sum(t.numel() for t in tensors)
        # every check must agree, on finite weights and with one inf planted
        assert not any(check(tensors) for check in checks.values())
        tensors[-1].view(-1)[0] = float("inf")
        assert all(check(tensors) for check in checks.values())
        tensors[-1].view(-1)[0] = 0.0
        times = [best_ms(lambda c=check, ts=tensors: c(ts), args.repeats) for check in checks.values()]
        print(
            f"| {layout} | {len(tensors)} | {n / 1e6:.0f}M | " + " | ".join(f"{t:.1f}" for t in times) + " |"
        )


if __name__ == "__main__":
    main()
