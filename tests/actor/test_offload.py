"""Which offloading the actor does itself (worker.actor.offload vs fsdp.enable_cpu_offload)."""

from __future__ import annotations

import pytest
import torch

from vlrl.config import ActorConfig
from vlrl.workers.actor import manual_offload

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _cfg(params: bool, optimizer: bool, fsdp_cpu_offload: bool) -> ActorConfig:
    cfg = ActorConfig()
    cfg.offload.offload_params, cfg.offload.offload_optimizer = params, optimizer
    cfg.fsdp.enable_cpu_offload = fsdp_cpu_offload
    return cfg


@pytest.mark.parametrize(("params", "optimizer"), [(True, True), (True, False), (False, True)])
def test_gpu_offload_as_configured(params, optimizer):
    assert manual_offload(_cfg(params, optimizer, False), CUDA) == (params, optimizer)


def test_nothing_to_offload_on_cpu():
    assert manual_offload(_cfg(True, True, False), CPU) == (False, False)


def test_fsdp_cpu_offload_keeps_optimizer_states_with_the_parameters():
    """FSDP's CPU offload leaves the shards on CPU: moving the states to the GPU for the update
    would put them on another device than their parameters."""
    assert manual_offload(_cfg(True, True, True), CUDA) == (False, False)
