"""The non-finite weight check: `nonfinite_screen` (a 2-norm per tensor: finite proves every element
finite), `any_nonfinite` (exact: the inf-norm when the screen flags) and `Actor.weights_finite`
across ranks (one flag all-reduced on the device; the exact check only when some rank flags)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from actor_helpers import init_gloo, launch

from vlrl.workers.optim import any_nonfinite, nonfinite_screen

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_any_nonfinite_finds_one_element(dtype: torch.dtype, bad: float) -> None:
    tensors = [torch.randn(7, 5).to(dtype), torch.zeros(0, dtype=dtype), torch.randn(300).to(dtype)]
    assert not any_nonfinite(tensors) and float(nonfinite_screen(tensors)) == 0.0
    tensors[2][123] = bad
    assert any_nonfinite(tensors) and float(nonfinite_screen(tensors)) == 1.0


def test_huge_finite_values_are_finite() -> None:
    """Their 2-norm overflows (the screen flags), the exact inf-norm check clears them."""
    huge = torch.full((4,), 3e38)
    assert float(nonfinite_screen([huge])) == 1.0
    assert not any_nonfinite([huge, torch.randn(3, dtype=torch.bfloat16)])
    huge[1] = float("nan")
    assert any_nonfinite([huge])


def test_mixed_dtypes_and_no_tensors() -> None:
    assert not any_nonfinite([])
    assert not any_nonfinite([torch.zeros(0)])
    flag = nonfinite_screen([], device="cpu")
    assert flag.dtype == torch.float32 and float(flag) == 0.0
    mixed = [torch.randn(3), torch.randn(3, dtype=torch.bfloat16)]
    assert not any_nonfinite(mixed)
    mixed[1][0] = float("inf")
    assert any_nonfinite(mixed)


def _fake_actor(tensors: list[torch.Tensor]) -> Any:
    """What `Actor.weights_finite` reads: the trainable params and the sharded model's collectives."""

    def all_reduce(values: list[float], op: Any) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return t.tolist()

    model = SimpleNamespace(
        device=torch.device("cpu"), world_size=dist.get_world_size(), all_reduce=all_reduce
    )
    return SimpleNamespace(params=[torch.nn.Parameter(t) for t in tensors], model=model)


def _job(rank: int, world: int, port: int, out_dir: str) -> None:
    from vlrl.workers.actor import Actor

    init_gloo(rank, world, port)
    results: dict[str, bool] = {}
    try:
        cases = {
            "finite": (torch.randn(50), torch.randn(50)),
            "nan on rank 1": (torch.randn(50), torch.tensor([1.0, float("nan")])),
            "huge on rank 0": (torch.full((3,), 3e38), torch.randn(50)),
            "inf on rank 0, rank 1 empty": (torch.tensor([float("inf")]), torch.zeros(0)),
        }
        for name, per_rank in cases.items():
            results[name] = Actor.weights_finite(_fake_actor([per_rank[rank]]))
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_weights_finite_agrees_across_ranks(tmp_path: Path) -> None:
    launch(_job, 2, str(tmp_path))
    expected = {
        "finite": True,
        "nan on rank 1": False,
        "huge on rank 0": True,
        "inf on rank 0, rank 1 empty": False,
    }
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == expected
