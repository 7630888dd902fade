"""Qwen3-VL-MoE in the FSDP2 actor: two gloo ranks on CPU, one spawn (see moe_job.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from actor_helpers import launch
from safetensors import safe_open

from vlrl.models.tiny import MOE_EXPERTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def job(actor_model, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    import moe_job

    out = tmp_path_factory.mktemp("moe")
    launch(moe_job.run, 2, actor_model("qwen3_vl_moe"), str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)], out


def test_experts_are_sharded_along_the_expert_dim(job):
    results, _ = job
    for r in results:
        assert r["moe_units"] == 2  # both tiny decoder layers are sparse, each its own FSDP unit
        assert len(r["shards"]) == 4  # gate_up_proj and down_proj of 2 layers
        for placements, local, full in r["shards"].values():
            assert placements == "(Shard(dim=0),)"
            assert full[0] == MOE_EXPERTS and local == (MOE_EXPERTS // 2, *full[1:])


@pytest.mark.parametrize("mode", ["token", "seq", "seq-mean-token-sum", "token-dynamic"])
def test_two_ranks_equal_the_full_batch_gradient(job, mode):
    """Experts and router included: routing, packing and the expert shards change no gradient."""
    rank0 = job[0][0]
    assert rank0[f"grad_keys_match/{mode}"]
    assert rank0[f"grad_err/{mode}"] < 1e-5
    assert rank0[f"grad_norm_err/{mode}"] < 1e-5


def test_training_lowers_the_loss_and_moves_every_expert_tensor(job):
    rank0 = job[0][0]
    losses = rank0["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
    assert rank0["experts_moved"] > 1e-4 and rank0["routers_moved"] > 1e-4


def test_exported_folder_has_qwen_expert_layout_and_reloads(job):
    results, out = job
    with safe_open(str(out / "hf" / "model.safetensors"), framework="pt") as f:
        shape = f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()
    assert shape[0] == MOE_EXPERTS and shape[1] < shape[2]  # [E, H, 2I]: Qwen's layout, what vLLM reads
    assert results[0]["hf_reload_err"] == 0.0  # transformers transposes back on load
