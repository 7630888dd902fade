"""`build_optimizer`'s choice of AdamW implementation (fused on accelerators, torch's loop on CPU)
and checkpoints that resume across the two (CPU has a fused kernel in torch 2.13, used here to
stand in for a GPU-written state)."""

from __future__ import annotations

import copy

import pytest
import torch

from vlrl.config import OptimConfig
from vlrl.workers import optim
from vlrl.workers.optim import adamw_implementation, build_optimizer, fused_adamw_supported


@pytest.mark.parametrize(
    ("device", "dtype", "fused"),
    [
        ("cuda", torch.float32, True),
        ("cuda", torch.bfloat16, True),
        ("cuda:3", torch.float16, True),
        ("cuda", torch.int64, False),
        ("cpu", torch.float32, False),  # CPU keeps today's numerics
        ("cpu", torch.bfloat16, False),
        ("meta", torch.float32, False),
    ],
)
def test_fused_only_on_accelerators(device: str, dtype: torch.dtype, fused: bool) -> None:
    assert fused_adamw_supported(device, dtype) is fused


def test_cpu_parameters_keep_the_default_loop() -> None:
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(4))]
    assert adamw_implementation(params) == "default"
    opt = build_optimizer(params, OptimConfig(lr=1e-2))
    assert opt.defaults["fused"] is None and opt.defaults["foreach"] is None


def test_one_parameter_off_the_accelerator_keeps_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """All or nothing: torch's fused step groups by device, but a mix (FSDP2 CPU offload keeps
    shards on the host) runs the loop everywhere."""
    monkeypatch.setattr(optim, "_get_fused_kernels_supported_devices", lambda: ["cuda", "meta"])
    on_meta = torch.empty(4, device="meta")
    assert adamw_implementation([on_meta]) == "fused"
    assert adamw_implementation([on_meta, torch.zeros(4)]) == "default"
    assert adamw_implementation([]) == "default"


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(5, 7, generator=g)),
        torch.nn.Parameter(torch.randn(7, generator=g)),
    ]


def _step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _adamw(params: list[torch.nn.Parameter], fused: bool) -> torch.optim.Optimizer:
    """`build_optimizer`'s AdamW with the implementation forced (CPU stands in for a GPU: fused)."""
    opt = build_optimizer(params, OptimConfig(lr=1e-2, weight_decay=0.1))
    if fused:
        opt.defaults["fused"] = True
        for group in opt.param_groups:
            group["fused"] = True
    return opt


@pytest.mark.parametrize(("write_fused", "read_fused"), [(True, False), (False, True)])
def test_state_resumes_across_implementations(write_fused: bool, read_fused: bool) -> None:
    ref_params = _params()
    ref = _adamw(ref_params, write_fused)
    for s in range(2):
        _step(ref, ref_params, s)
    saved = copy.deepcopy(ref.state_dict())
    assert {k for st in saved["state"].values() for k in st} == {"step", "exp_avg", "exp_avg_sq"}

    params = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
    resumed = _adamw(params, read_fused)
    resumed.load_state_dict(saved)
    # the run's own choice wins over the saved group's flag, and `step` sits where it is read
    assert all(bool(g["fused"]) is read_fused for g in resumed.param_groups)
    for st in resumed.state.values():
        assert st["step"].dtype == torch.float32 and float(st["step"]) == 2.0
    for s in range(2, 4):
        _step(ref, ref_params, s)
        _step(resumed, params, s)
    for a, b in zip(ref_params, params):
        # the two kernels round differently, nothing more
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert all(float(st["step"]) == 4.0 for st in resumed.state.values())
