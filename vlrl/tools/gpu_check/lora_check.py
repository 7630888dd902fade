"""Check: a LoRA actor on the GPU (base in bf16, adapters fp32, FSDP2) merges its adapters for the
engines exactly as peft's `merge_and_unload` does on the same weights (`full_named_tensors`, the
weight sync's stream, against peft on the gathered wrapped state)."""

from __future__ import annotations

from typing import Any

import torch

from vlrl.tools.gpu_check.context import Context, single_rank_world
from vlrl.tools.gpu_check.inputs import make_config
from vlrl.tools.gpu_check.report import Outcome

RELATIVE = 2.0**-7  # two bf16 roundings of W + delta apart at most


def check_lora(ctx: Context, outcome: Outcome) -> None:
    from vlrl.models.processor import load_processor
    from vlrl.rollout.weight_sync import _gathered, full_named_tensors
    from vlrl.workers.from_config import build_actor
    from vlrl.workers.optim import local

    path = ctx.tiny_model("qwen2_5_vl")
    config = make_config(path, ctx.device, **{"worker.actor.model.lora.rank": 8, "worker.actor.model.lora.alpha": 16,
                                               "worker.actor.model.lora.target_modules": "all-linear"})  # fmt: skip
    with single_rank_world(ctx.device):
        actor = build_actor(config, load_processor(path)[1], ctx.device, model_path=path)
        module = actor.model.module
        gen = torch.Generator(device="cpu").manual_seed(ctx.seed)
        with torch.no_grad():  # trained-looking adapters (B starts at zero: the merge would be a no-op)
            for name, param in module.named_parameters():
                if "lora_B" in name:
                    shard = local(param)
                    shard.copy_(torch.randn(shard.shape, generator=gen).to(shard) * 0.05)
        dtypes = {str(p.dtype) for p in module.parameters() if not p.requires_grad}
        wrapped = {name: t.detach().cpu() for name, t in _gathered(module, None)}
        ours = {name: t.detach().cpu() for name, t in full_named_tensors(module)}
    reference = _peft_merge(path, config.worker.actor.model.lora, wrapped)
    outcome.details.update(frozen_dtypes=sorted(dtypes), tensors=len(ours))
    outcome.expect(
        ours.keys() == reference.keys(), f"merged names differ: {sorted(ours.keys() ^ reference.keys())[:4]}"
    )
    worst = 0.0
    for name in ours.keys() & reference.keys():
        ref = reference[name].float()
        excess = ((ours[name].float() - ref).abs() - RELATIVE * ref.abs()).max()
        worst = max(worst, float(excess))
    outcome.summary["merge_excess"] = worst
    outcome.expect(
        worst <= 1e-6, f"merged weights differ from peft's merge by {worst:.3g} beyond bf16 rounding"
    )
    if ctx.cuda:
        outcome.expect(dtypes == {str(torch.bfloat16)}, f"LoRA base stored in {sorted(dtypes)}, not bf16")


def _peft_merge(path: str, lora_cfg, wrapped: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's own merge of a wrapped model holding `wrapped` (CPU, the actor's dtypes)."""
    from vlrl.models.loading import load_model
    from vlrl.models.lora import apply_lora

    model: Any = apply_lora(load_model(path, dtype=torch.float32), lora_cfg)  # a peft.PeftModel
    model.load_state_dict(wrapped, strict=True, assign=True)
    return {name: t.detach() for name, t in model.merge_and_unload().state_dict().items()}
