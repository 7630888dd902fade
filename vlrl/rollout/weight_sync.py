"""Weight sync actor -> rollout engine: gather shards, map names, convert dtype, load in buckets.

    sync_weights(actor_module, engine, bucket_mb) -> {"sync/time_s", "sync/peak_extra_mb", "sync/bytes"}

1. Walk the module's `state_dict()` in its order. FSDP2 holds parameters as DTensor shards;
   `.full_tensor()` all-gathers one (a collective: every rank walks the same order, so every rank
   must call `sync_weights`, including TP peers and ranks with nothing to generate).
   A LoRA model's adapted weights are merged on the way (W + alpha/r * B @ A, `vlrl.models.lora`),
   so the engine gets plain weights under plain names and needs no adapter support.
2. Map transformers-5 runtime names to checkpoint names (`checkpoint_name`): wrapper prefixes
   (`_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`, `_orig_mod.`) are dropped, and Qwen2-VL /
   Qwen2.5-VL's `model.language_model.` / `model.visual.` become the `model.` / `visual.` of their
   checkpoints (each family's prefixes: `vlrl.models.families`). Engines load checkpoints, so checkpoint names are what every loader understands.
   Tensors keep their layout except Qwen3-VL-MoE's fused experts (`checkpoint_tensor`): transformers
   5 holds them as the transpose of Qwen's checkpoints, and vLLM reads the checkpoint layout.
3. Convert to the engine's dtype and group into buckets of at most `bucket_mb` (a tensor larger
   than the bucket travels alone). The engine consumes the buckets lazily, so at most one bucket of
   gathered/converted tensors is alive at a time: that bounds the extra memory of a sync.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vlrl.models.families import Family
from vlrl.models.moe import checkpoint_layout

_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def checkpoint_name(name: str, family: Family) -> str:
    """The checkpoint name of a state_dict key of the actor (any wrappers removed; the family's
    runtime -> checkpoint prefixes applied)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    for old, new in family.checkpoint_prefixes:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def checkpoint_tensor(name: str, tensor: torch.Tensor, family: Family) -> torch.Tensor:
    """`tensor` (actor state_dict key `name`) in its checkpoint layout: a transposed view for
    fused experts stored transposed (`vlrl.models.moe`; bucketize makes it contiguous), else itself."""
    return checkpoint_layout(name, tensor) if family.transposed_experts else tensor


def runtime_name(name: str) -> str:
    """A state_dict key with wrapper prefixes removed (the names of a plain transformers model)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


@dataclass
class SyncStats:
    """What one sync moved, and the memory it took on top of what was there when it started."""

    bytes: int = 0
    tensors: int = 0
    largest_bucket: int = 0  # bytes
    base_rss: int = -1  # CPU: resident set size when the sync started (-1: not measuring)
    peak_rss: int = 0

    def start_rss(self) -> None:
        self.base_rss = self.peak_rss = _rss()

    def sample(self) -> None:
        """Record the current RSS (CPU syncs; cheap enough to call once per tensor)."""
        if self.base_rss >= 0:
            self.peak_rss = max(self.peak_rss, _rss())

    @property
    def peak_extra_rss(self) -> int:
        return max(0, self.peak_rss - self.base_rss) if self.base_rss >= 0 else 0


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def full_named_tensors(
    module: torch.nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every state_dict entry in order; DTensor shards are all-gathered.

    `dtype`: floating tensors are cast to it before the all-gather (a bf16 engine: half the bytes
    gathered and a smaller peak than gathering fp32 and casting after). A tied weight (an lm head
    sharing the embedding) is gathered once and sent under each of its names (`tied_aliases`). A LoRA model
    (`vlrl.models.lora`) yields its merged weights under the transformers names; its adapter
    factors are gathered in their own dtype (they are small) so the merge stays exact."""
    from vlrl.models.lora import is_lora_model, lora_scaling_of, merged_named_tensors

    if is_lora_model(module):
        return merged_named_tensors(_gathered(module, dtype, keep_factors=True), lora_scaling_of(module))
    return _gathered(module, dtype)


def tied_aliases(module: torch.nn.Module) -> dict[str, list[str]]:
    """{first name: later names of the same parameter} (tied embeddings: the lm head).

    Decided from the module's structure, the same on every rank (each rank must run the same
    all-gathers). The engines still want every name (vLLM 0.32's layerwise reload lists a tied
    `lm_head.weight` among the parameters to load), so an alias gets the tensor already gathered."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.setdefault(first[id(param)], []).append(name)
        else:
            first[id(param)] = name
    return aliases


def _gathered(
    module: torch.nn.Module, dtype: torch.dtype | None, keep_factors: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """State_dict entries, all-gathered, cast first; a tied alias follows its first name at once."""
    from torch.distributed.tensor import DTensor

    from vlrl.models.lora import is_adapter_factor

    aliases = tied_aliases(module)
    skip = {alias for names in aliases.values() for alias in names}
    for name, value in module.state_dict().items():
        if name in skip:
            continue
        cast = dtype is not None and value.is_floating_point() and value.dtype != dtype
        if cast and not (keep_factors and is_adapter_factor(name)):
            value = value.to(dtype)  # a DTensor casts its local shard: no communication
        # full_tensor() is a collective: every rank reaches it in the same order.
        full = value.full_tensor() if isinstance(value, DTensor) else value
        yield name, full
        for alias in aliases.get(name, ()):
            yield alias, full


def bucketize(
    named: Iterable[tuple[str, torch.Tensor]],
    bucket_mb: float,
    dtype: torch.dtype | None,
    stats: SyncStats | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) into lists of at most `bucket_mb` MiB after converting to `dtype`.

    Floating tensors are converted (integer buffers keep their dtype), detached and made contiguous.
    The input is pulled lazily, so a bucket's tensors are released once the consumer asks for the next.
    """
    limit = int(bucket_mb * (1 << 20))
    if limit <= 0:
        raise ValueError(f"bucket_mb={bucket_mb} must be > 0")
    stats = stats if stats is not None else SyncStats()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)  # a gathered full-precision tensor is freed right here
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        stats.bytes += nbytes
        stats.tensors += 1
        stats.largest_bucket = max(stats.largest_bucket, size)
        stats.sample()
    if bucket:
        yield bucket


def sync_weights(module: torch.nn.Module, engine: Any, bucket_mb: float) -> dict[str, float]:
    """Push `module`'s weights (plain or FSDP2-sharded) into `engine`; returns sync metrics.

    `sync/peak_extra_mb` is measured: on CUDA the peak of allocated memory above its level at the
    start (gathers, conversions and the engine's loading buffers); on CPU the peak resident set size
    above its level at the start, sampled after every tensor. `sync/bucket_mb` is the largest bucket.
    """
    start = time.perf_counter()
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    stats = SyncStats()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        stats.start_rss()
    engine.load_weights(full_named_tensors(module, engine.weight_dtype), bucket_mb=bucket_mb, stats=stats)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        stats.sample()
        peak = stats.peak_extra_rss
    return {
        "sync/time_s": time.perf_counter() - start,
        "sync/peak_extra_mb": peak / (1 << 20),
        "sync/bucket_mb": stats.largest_bucket / (1 << 20),
        "sync/bytes": float(stats.bytes),
    }
