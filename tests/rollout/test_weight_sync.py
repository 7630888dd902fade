"""Weight sync without an engine: name mapping, buckets, DTensor gathering, metrics."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rollout_helpers import free_port, init_world, load_hf_model
from safetensors import safe_open

from vlrl.models.families import FAMILIES, family_of
from vlrl.models.tiny import ARCHS
from vlrl.rollout.weight_sync import (
    bucketize,
    checkpoint_name,
    checkpoint_tensor,
    full_named_tensors,
    sync_weights,
)


@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_names_map_to_checkpoint_names(tiny_model, arch):
    """transformers-5 runtime names and layouts -> exactly the names and shapes of the checkpoint
    (what loaders read; for qwen3_vl_moe the tiny builder writes Qwen's transposed expert layout)."""
    path = tiny_model(arch)
    model = load_hf_model(path)
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        on_disk = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    family = family_of(model.config)
    mapped = {
        checkpoint_name(n, family): checkpoint_tensor(n, t, family) for n, t in model.state_dict().items()
    }
    assert mapped.keys() == on_disk.keys()
    for name, tensor in mapped.items():
        assert torch.equal(tensor, on_disk[name]), name


def test_moe_experts_travel_in_checkpoint_layout():
    experts = torch.arange(24.0).reshape(2, 3, 4)  # [E, 2I, H]
    name = "model.language_model.layers.1._checkpoint_wrapped_module.mlp.experts.gate_up_proj"
    assert checkpoint_tensor(name, experts, FAMILIES["qwen3_vl_moe"]).shape == (2, 4, 3)
    assert checkpoint_tensor(name, experts, FAMILIES["qwen3_vl"]) is experts
    router = torch.ones(4, 8)
    assert (
        checkpoint_tensor("model.language_model.layers.0.mlp.gate.weight", router, FAMILIES["qwen3_vl_moe"])
        is router
    )


def test_wrapper_prefixes_are_dropped():
    name = "model.language_model.layers.0._checkpoint_wrapped_module.mlp._orig_mod.up_proj.weight"
    assert checkpoint_name(name, FAMILIES["qwen2_5_vl"]) == "model.layers.0.mlp.up_proj.weight"
    assert (
        checkpoint_name("model.visual.blocks.0.attn.qkv.weight", FAMILIES["qwen2_vl"])
        == "visual.blocks.0.attn.qkv.weight"
    )
    assert (
        checkpoint_name("model.visual.blocks.0.attn.qkv.weight", FAMILIES["qwen3_vl"])
        == "model.visual.blocks.0.attn.qkv.weight"
    )
    with pytest.raises(ValueError, match="no family record"):
        family_of({"model_type": "llama4", "vision_config": {}})


def test_buckets_respect_the_limit_and_convert_dtype():
    tensors = [(f"t{i}", torch.ones(256, 256)) for i in range(6)]  # 256 KiB each in fp32, 128 KiB in bf16
    buckets = list(bucketize(iter(tensors), bucket_mb=0.3, dtype=torch.bfloat16))
    assert [len(b) for b in buckets] == [2, 2, 2]
    assert all(t.dtype == torch.bfloat16 for b in buckets for _, t in b)
    big = list(bucketize(iter([("big", torch.ones(1024, 1024)), ("small", torch.ones(2))]), 0.1, None))
    assert [[n for n, _ in b] for b in big] == [["big"], ["small"]]  # an oversized tensor travels alone
    ints = list(bucketize(iter([("ids", torch.arange(3))]), 1, torch.bfloat16))
    assert ints[0][0][1].dtype == torch.long


class RecordingEngine:
    """Stands in for an engine: records the buckets it is given."""

    weight_dtype = torch.bfloat16

    def __init__(self) -> None:
        self.buckets: list[list[tuple[str, torch.Tensor]]] = []

    def load_weights(self, named, bucket_mb=None, stats=None):
        for bucket in bucketize(named, bucket_mb, self.weight_dtype, stats):
            self.buckets.append([(name, t.clone()) for name, t in bucket])


def test_sync_gathers_dtensor_shards_and_reports_metrics():
    """A module whose parameters are DTensors (as under FSDP2) arrives whole, in order, converted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    init_world(0, 1, free_port())
    try:
        module = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
        reference = {k: v.clone() for k, v in module.state_dict().items()}
        mesh = init_device_mesh("cpu", (1,))
        for layer in module:
            for name, param in list(layer.named_parameters()):
                setattr(layer, name, torch.nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)])))
        assert all(type(v).__name__ == "DTensor" for v in module.state_dict().values())
        assert [n for n, _ in full_named_tensors(module)] == list(reference)
        engine = RecordingEngine()
        metrics = sync_weights(module, engine, bucket_mb=0.01)
    finally:
        dist.destroy_process_group()
    received = dict(item for bucket in engine.buckets for item in bucket)
    assert list(received) == list(reference) and len(engine.buckets) > 1
    for name, value in reference.items():
        assert received[name].dtype == torch.bfloat16 and torch.equal(received[name], value.bfloat16())
    assert metrics["sync/bytes"] == sum(v.numel() * 2 for v in reference.values())
    assert metrics["sync/time_s"] > 0 and metrics["sync/peak_extra_mb"] >= 0
    assert metrics["sync/bucket_mb"] == 64 * 128 * 2 / 2**20  # the largest tensor travels alone
