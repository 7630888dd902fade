"""The model's forward returns final hidden states; the lm head runs later, per chunk of tokens.

A transformers causal LM ends its forward with `logits = self.lm_head(hidden_states[:, kept, :])`
(transformers 5.19: qwen2, qwen3, llama, qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe), i.e. a
[.., K, V] tensor for the K kept positions: at 64k scored tokens and a 152k vocab that is 20 GB in
bf16, and autograd keeps it for the backward. `passthrough_head` makes the head return its input
for one forward, so the model's `.logits` are the hidden states [.., K, H] instead, and
`vlrl.models.packing.score_tokens` applies the real head to a chunk of tokens at a time inside a
checkpointed function: no [K, V] tensor ever exists and autograd keeps only [K, H].

FSDP2 (vlrl.workers.fsdp): the head belongs to the root unit, sharded with
reshard_after_forward=False. After the root's forward its parameters stay unsharded -- FSDP2 sets
the unsharded `nn.Parameter` on the module (`FSDPParam.to_unsharded` / `_setattr_on_modules`) and
`FSDPParamGroup.reshard` returns early in the forward -- until the root's post-backward (or
`vlrl.workers.fsdp.reshard` after a forward without backward), so calling the head after the
forward uses the gathered weight (torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
_fsdp_param_group.py). The chunks' backward accumulates the head's gradient into that unsharded
parameter's `.grad` (before the root's pre-backward hook on its outputs fires, which does not touch
it: `unshard` is a no-op on an unsharded group). The root's forward inputs (token ids) need no
gradient, so its post-backward -- which reduce-scatters every unsharded `.grad` of the group, the
head's included -- runs in `_root_post_backward_final_callback` after the whole backward (torch
2.13, torch/distributed/fsdp/_fully_shard/_fsdp_state.py). A tied head (lm_head.weight is
embed_tokens.weight) is the same unsharded parameter, so both uses add into one `.grad`.

Every rank must give the head's weight a gradient in every backward (possibly zero), or the
ranks' reduce-scatters differ: `vlrl.models.packing.forward_log_probs` runs the head over one row
of the anchor/extra hidden states inside its zero-valued anchor term, whatever was scored.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn


def output_head(model: nn.Module) -> nn.Module | None:
    """The module that turns final hidden states into logits (`get_output_embeddings()`), or None.

    Through a peft wrapper (vlrl.models.lora) the lookup reaches the transformers model (peft
    forwards unknown attributes to it); an adapted head is the peft layer wrapping the linear, whose
    call applies base weight and adapters alike. An FSDP2 module keeps its class's methods."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, nn.Module) else None


def check_gathered(head: nn.Module) -> None:
    """Raise if FSDP left the head's parameters sharded (DTensors) after the forward: the head can
    then not run outside it (the root unit must keep reshard_after_forward=False, see above)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in head.parameters()):
        raise RuntimeError(
            "the lm head's parameters are sharded after the forward: the FSDP2 root unit (embeddings, "
            "final norm, lm head) must be sharded with reshard_after_forward=False (vlrl.workers.fsdp)"
        )


@contextmanager
def passthrough_head(head: nn.Module) -> Iterator[list[int]]:
    """Within the block, `head(x)` returns x (the model's `.logits` are then its hidden states).

    Yields a one-item list counting the head's calls, so the caller can check that the forward
    went through it exactly once. The instance's `forward` attribute is restored on exit."""
    calls = [0]

    def passthrough(hidden: Tensor) -> Tensor:
        calls[0] += 1
        return hidden

    saved = head.__dict__.get("forward")  # e.g. a hook library's instance-level forward, else None
    head.forward = passthrough  # an instance attribute shadows the class's method
    try:
        yield calls
    finally:
        if saved is not None:
            head.forward = saved
        else:
            del head.forward
