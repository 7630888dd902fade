"""FSDP2 sharding of a Hugging Face model over a device mesh, and moving it between devices.

Mesh (`worker.actor.fsdp.fsdp_size`, `build_mesh`): by default one 1-D mesh ("fsdp") over all ranks,
each parameter split into `world` shards. With `fsdp_size = S` smaller than the world W, a 2-D mesh
[W / S, S] named ("replicate", "shard"): rows are groups of S consecutive ranks (one node each
when S is the ranks per node, see vlrl.trainer.ray_workers.rank_placement), each row holds one
full copy split into S shards, and the rows are replicas. FSDP2 reads a 2-D mesh as HSDP
(torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_init.py `_get_mesh_info`: shard dim 1,
replicate dim 0; placements `(Replicate(), Shard(0))`): parameter all-gathers and gradient
reduce-scatters run inside a row, and one extra all-reduce of each reduce-scattered gradient
shard runs down a column (_fsdp_collectives.py `foreach_reduce`). Both reductions average, so a
gradient is still the mean over all W ranks (`_get_gradient_divide_factors`). The actor runs that
all-reduce once per mini-batch, on its last micro-batch's backward (`set_replica_all_reduce`);
the reduce-scatter runs on every micro-batch, so gradients stay sharded.

Units: every module whose class is listed in the model's `_no_split_modules` (decoder layers and
vision blocks), then the vision tower as a whole (patch embed + merger), then the root (embeddings,
final norm, lm head). Each unit all-gathers its parameters just before its forward/backward and
frees them after, so peak memory is about one layer's full weights plus the shards. The root stays
gathered from its forward through its backward (it would be re-gathered at once otherwise).

Precision (`worker.actor.fsdp`):
- GPU default: fp32 master weights, bf16 compute (`MixedPrecisionPolicy(param_dtype=bf16)`),
  fp32 gradient reduction (`mp_reduce_dtype`).
- GPU pure bf16 (`torch_dtype=bfloat16`): weights stored in bf16, reduction still in `mp_reduce_dtype`.
- CPU: no mixed precision; fp32 unless `torch_dtype` says otherwise. gloo process group.

Gradients are AVERAGED over ranks by FSDP's reduce-scatter; the actor multiplies its loss by the
world size so the result is the gradient of the loss summed over ranks (see docs/actor.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from vlrl.config import FSDPConfig
from vlrl.models.loading import parse_dtype, vision_tower


def world_info() -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialized process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_group_size(fsdp_size: int, world: int) -> int:
    """Ranks per sharding group: `fsdp_size`, or the whole world for -1 (or the world size)."""
    if fsdp_size == -1:
        return world
    if fsdp_size < 1 or world % fsdp_size:
        raise ValueError(
            f"fsdp_size={fsdp_size} (worker.actor.fsdp / worker.ref.fsdp) must be -1 or divide the world size {world} "
            "(ranks per sharding group; the groups replicate each other)"
        )
    return fsdp_size


def build_mesh(device: torch.device, fsdp_size: int = -1) -> DeviceMesh:
    """The FSDP mesh over all ranks of the default process group (gloo on CPU, NCCL on GPU).

    1-D ("fsdp",) [W] when the sharding group is the world, else 2-D ("replicate", "shard")
    [W / S, S] for hybrid sharding (see the module docstring). Collective: every rank calls it."""
    _, world = world_info()
    size = shard_group_size(fsdp_size, world)
    if size == world:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    return init_device_mesh(device.type, (world // size, size), mesh_dim_names=("replicate", "shard"))


def master_dtype(fsdp: FSDPConfig) -> torch.dtype:
    """Dtype the (sharded) weights are stored in: `torch_dtype`, default float32."""
    return parse_dtype(fsdp.torch_dtype, torch.float32)


def frozen_dtype(fsdp: FSDPConfig, device: torch.device) -> torch.dtype:
    """Dtype of weights that get no gradient (a LoRA actor's base): the compute dtype on GPU.

    They need no fp32 master copy: in fp32 a 7B base would take 28 GB instead of 14 GB and be cast
    at every all-gather. `torch_dtype` still wins when set; on CPU (fp32 compute) it is fp32."""
    mp = mixed_precision(fsdp, device)
    if fsdp.torch_dtype is not None or mp is None or mp.param_dtype is None:
        return master_dtype(fsdp)
    return mp.param_dtype


def mixed_precision(fsdp: FSDPConfig, device: torch.device) -> MixedPrecisionPolicy | None:
    """bf16 (`mp_param_dtype`) compute with `mp_reduce_dtype` gradient reduction on GPU; None on CPU."""
    if device.type == "cpu":
        return None
    return MixedPrecisionPolicy(
        param_dtype=parse_dtype(fsdp.mp_param_dtype), reduce_dtype=parse_dtype(fsdp.mp_reduce_dtype)
    )


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Inner FSDP units in forward order of depth: layers/blocks first, then the vision tower."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise ValueError(f"{type(model).__name__} lists no _no_split_modules; cannot pick FSDP units")
    tower = vision_tower(model)
    if tower is not None:
        units.append(tower)
    return units


def fsdp_offloads_to_cpu(fsdp: FSDPConfig, device: torch.device | str) -> bool:
    """True when FSDP2 itself keeps the shards (and so the optimizer states) in host memory."""
    return fsdp.enable_cpu_offload and torch.device(device).type == "cuda"


def apply_fsdp(
    model: torch.nn.Module, device: torch.device, fsdp: FSDPConfig, mesh: DeviceMesh | None = None
) -> torch.nn.Module:
    """Shard `model` in place with FSDP2 (`fully_shard`) and return it (now an `FSDPModule`).

    Parameters move to `device` (kept on CPU between uses with `fsdp.enable_cpu_offload` on GPU).
    """
    mesh = mesh or build_mesh(device, fsdp.fsdp_size)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": fsdp.enable_full_shard}
    mp = mixed_precision(fsdp, device)
    if mp is not None:
        kwargs["mp_policy"] = mp
    if fsdp_offloads_to_cpu(fsdp, device):
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for unit in shard_units(model):
        fully_shard(unit, **kwargs)
    # The root (embeddings, final norm, lm head) is the last unit of the forward and the first of
    # the backward: freeing it after the forward only means gathering it again at once for every
    # micro-batch's backward. Its gathered weights are freed after the backward (and after a
    # forward without backward by `reshard`).
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    return model


def is_hybrid(model: torch.nn.Module) -> bool:
    """Whether `model` is sharded over a 2-D (replicate, shard) mesh (HSDP, see `build_mesh`)."""
    param = next(model.parameters(), None)
    mesh = getattr(param, "device_mesh", None)
    return mesh is not None and mesh.ndim == 2


def set_replica_all_reduce(model: torch.nn.Module, enabled: bool) -> None:
    """HSDP: whether the next backward all-reduces the gradients across replicas (every FSDP unit).

    torch 2.13, torch/distributed/fsdp/_fully_shard/_fully_shard.py `set_requires_all_reduce`
    sets each param group's `all_reduce_grads`; the reduce-scatter inside the shard group still
    runs on every backward (`set_requires_gradient_sync(False)` would skip it too and keep the
    unsharded gradients, a full copy per unit). With it off, _fsdp_collectives.py `foreach_reduce`
    adds the reduce-scattered shard into the group's `_partial_reduce_output` (the size of the
    unit's gradient shard, in the reduce dtype) instead of `.grad`; the next backward with it on
    adds that partial sum before its one all-reduce. So gradient accumulation over k micro-batches
    costs one cross-replica all-reduce instead of k, and no more memory: the shard-sized partial
    stands in for the `.grad` shard that is only written on the all-reduced backward."""
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(enabled)  # recurses into every FSDP unit


def pending_replica_reduce(model: torch.nn.Module) -> bool:
    """Whether some FSDP unit still holds a reduce-scattered gradient not yet all-reduced across
    replicas (`set_replica_all_reduce`): the gradient of those micro-batches would miss the step.

    Reads the param groups' `_partial_reduce_output` (torch 2.13 _fsdp_param_group.py; reset to
    None by the all-reducing backward, `foreach_reduce`'s last return value)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            groups = module._get_fsdp_state()._fsdp_param_groups
            if any(getattr(g, "_partial_reduce_output", None) is not None for g in groups):
                return True
    return False


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters of every FSDP unit of `model`.

    FSDP2 frees a unit's gathered parameters after its forward only with `reshard_after_forward`
    (and never for the root, see `apply_fsdp`); otherwise only after the backward (torch 2.13,
    torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, `post_forward` / `reshard`). A
    forward without a backward (the reference policy, `enable_full_shard=false`) would leave the
    whole model gathered. `FSDPModule.reshard` is not recursive, hence the loop."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def broadcast_weights_from_rank0(model: torch.nn.Module, full_state: dict[str, torch.Tensor] | None) -> None:
    """Fill a sharded model built on meta (ranks > 0) from rank 0's full state dict.

    Every rank calls this; only rank 0 passes `full_state`. Parameters are materialized with
    `to_empty` and then scattered; buffers (not sharded, e.g. rotary inv_freq) are broadcast.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank, _ = world_info()
    device = next(p for p in model.parameters()).device
    if device.type == "meta":
        raise ValueError("call model.to_empty(device=...) before broadcasting")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, (full_state or {}) if rank == 0 else {}, options=options)  # type: ignore[arg-type]
    for buffer in model.buffers():
        dist.broadcast(buffer.data, src=0)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gathered full weights on CPU, on rank 0 (other ranks get {}). Collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state  # type: ignore[return-value]  # full_state_dict=True gives plain tensors


def move_params(model: torch.nn.Module, device: torch.device | str) -> None:
    """Move the (sharded) parameters and buffers, e.g. to CPU while the rollout engine runs.

    Only meaningful on GPU; on CPU it is a no-op (nothing to free).
    """
    device = torch.device(device)
    current = next(model.parameters()).device
    if current.type == "cpu" and device.type == "cpu":
        return
    model.to(device)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every optimizer state tensor (AdamW moments) to `device` (no-op when already there)."""
    device = torch.device(device)
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device and key != "step":
                state[key] = value.to(device, non_blocking=True)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
