"""Ulysses sequence parallelism: the collectives and the token split of a packed row.

`worker.actor.ulysses_size = sp` groups sp consecutive ranks; the ranks of a group get the same
micro-batches and each holds 1/sp of every packed row's tokens (`token_bounds`). Everything per
token (embeddings, norms, MLPs, rotary, the lm head, the log-prob scoring) runs on the local slice.
Attention needs every token of a sequence, so around it the group exchanges (all-to-all)
"all heads of my tokens" for "my heads of all tokens":

    q [1, H, T/sp, D] --seq_to_heads--> [1, H/sp, T, D] --varlen attention--> [1, H/sp, T, D]
                                                          --heads_to_seq--> [1, H, T/sp, D]

k/v likewise with the kv heads (repeated up to sp first when there are fewer than sp). The
response log-probs computed on the slices are put together with `gather_tokens`. All three are
autograd functions, so the backward runs the transposed exchange and every parameter gradient is
the one of the unsplit forward (tests/actor/test_ulysses.py compares against ulysses_size=1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: `size` ranks, this one at position `rank` in it."""

    group: Any  # torch.distributed ProcessGroup
    size: int
    rank: int


def build_sequence_parallel(size: int) -> SequenceParallel | None:
    """Groups of `size` consecutive ranks (collective: every rank calls it); None when size is 1."""
    if size <= 1:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % size:
        raise ValueError(f"worker.actor.ulysses_size={size} must divide the world size {world}")
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))  # every rank creates every group
        if start <= rank < start + size:
            mine = group
    return SequenceParallel(mine, size, rank % size)


def head_errors(hf_config: Any, size: int) -> list[str]:
    """Why the text decoder's heads cannot be split over `size` ranks (empty when they can)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    errors = []
    if heads % size:
        errors.append(
            f"the model's {heads} attention heads are not divisible by worker.actor.ulysses_size={size}"
        )
    if kv % size and size % kv:
        errors.append(
            f"the model's {kv} key/value heads must be divisible by worker.actor.ulysses_size={size} "
            f"(or divide it: then they are repeated)"
        )
    return errors


def token_bounds(total: int, sp: SequenceParallel) -> tuple[int, int]:
    """[start, end) of this rank's slice of a packed row of `total` tokens (a multiple of sp)."""
    if total % sp.size:
        raise ValueError(f"a packed row of {total} tokens cannot be split over {sp.size} ranks")
    local = total // sp.size
    return sp.rank * local, (sp.rank + 1) * local


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (equal chunks); its transpose is the same exchange.

    Device note (torch 2.13, torch/distributed/distributed_c10d.py::all_to_all_single, marked
    experimental there): on gloo the call blocks on CPU tensors; on NCCL it is queued on the current
    CUDA stream and needs the tensors on this rank's device, so `out` is allocated like `x`. Only the
    gloo path has run (tests/actor/test_ulysses.py); an SP group needs two GPUs to test NCCL."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        x = x.contiguous()  # (empty_like would copy a view's strides; the collective writes densely)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: Tensor, sp: SequenceParallel) -> Tensor:
    """[1, H, T/sp, D] (all heads, my tokens) -> [1, H/sp, T, D] (my heads, all tokens in order)."""
    _, heads, local, dim = x.shape
    chunks = x[0].reshape(sp.size, heads // sp.size, local, dim)  # chunk j: the heads rank j gets
    got = _AllToAll.apply(chunks, sp.group)  # chunk j: my heads of rank j's tokens
    return got.transpose(0, 1).reshape(1, heads // sp.size, sp.size * local, dim)


def heads_to_seq(x: Tensor, sp: SequenceParallel) -> Tensor:
    """[1, H/sp, T, D] (my heads, all tokens) -> [1, H, T/sp, D] (all heads, my tokens)."""
    _, heads, total, dim = x.shape
    local = total // sp.size
    chunks = x[0].reshape(heads, sp.size, local, dim).transpose(0, 1)  # chunk j: rank j's tokens
    got = _AllToAll.apply(chunks, sp.group)  # chunk j: rank j's heads of my tokens
    return got.reshape(1, heads * sp.size, local, dim)


def repeat_kv_for(kv: Tensor, sp: SequenceParallel) -> Tensor:
    """k/v [1, Hkv, T/sp, D] with Hkv < sp: each head repeated so every rank gets one (its queries'
    head: rank j's query heads all read kv head j * Hkv / sp). Autograd sums the copies' gradients."""
    heads = kv.shape[1]
    return kv if heads % sp.size == 0 else kv.repeat_interleave(sp.size // heads, dim=1)


class _GatherTokens(torch.autograd.Function):
    """Concatenate the ranks' 1-D slices of `counts[j]` values each (padded to the largest for the
    collective). Backward: the gradient is summed over the group (each rank's loss uses every
    slice) and each rank keeps its own slice's part."""

    @staticmethod
    def forward(ctx, local: Tensor, counts: list[int], sp: SequenceParallel) -> Tensor:
        ctx.counts, ctx.sp = counts, sp
        width = max(max(counts), 1)  # gloo cannot gather empty tensors
        padded = torch.zeros(width, dtype=local.dtype, device=local.device)
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in range(sp.size)]
        dist.all_gather(parts, padded, group=sp.group)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.sp.group)
        start = sum(ctx.counts[: ctx.sp.rank])
        return grad[start : start + ctx.counts[ctx.sp.rank]], None, None


def gather_tokens(local: Tensor, counts: list[int], sp: SequenceParallel) -> Tensor:
    """[counts[rank]] on each rank -> [sum(counts)] on every rank, in rank order (autograd)."""
    if local.numel() != counts[sp.rank]:
        raise ValueError(f"rank {sp.rank} holds {local.numel()} values, expected {counts[sp.rank]}")
    return _GatherTokens.apply(local, counts, sp)
