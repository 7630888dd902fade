"""Check d: an actor update of a random-init model with Qwen2.5-VL-3B's shapes: tokens/s, MFU, peak memory.

The model has the published shapes of Qwen/Qwen2.5-VL-3B-Instruct (values below) but random
weights, and our tiny tokenizer/processor (vlrl.models.tiny): nothing is downloaded. Token ids
stay below the tiny vocabulary, which changes nothing in the cost (the embedding and the lm head
still have 151,936 rows). It is written as a real model folder so the actor loads it the way it
loads any checkpoint. MFU counts the decoder's model FLOPs only (vlrl.models.flops).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from vlrl.tools.gpu_check.context import Context, memory, single_rank_world, sync
from vlrl.tools.gpu_check.inputs import (
    actor_log_probs,
    make_config,
    prompt_batch,
    random_rollout,
    training_fields,
)
from vlrl.tools.gpu_check.report import Outcome

RETURN_MIB = 64  # allocated memory a no-grad pass may leave behind (its outputs are on the CPU)
MFU_GOAL = 0.35  # issue 14's P5 goal for an H100 (EasyR1 reports 8.1% for 3B)

# Qwen/Qwen2.5-VL-3B-Instruct's config.json (the model card's values; transformers 5.x'
# Qwen2_5_VLConfig defaults describe a larger model: text hidden 8192 / 80 layers, vision
# hidden_size 3584, so they are not used). head_dim = 2048 / 16 = 128, mrope_section sums to 64.
QWEN25_VL_3B_TEXT = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    tie_word_embeddings=True,
)
QWEN25_VL_3B_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=2048,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
    hidden_act="silu",
)
# The CPU self-test's stand-in: same structure (GQA 2:1 here, windowed + full-attention vision
# blocks, tied embeddings), tiny sizes.
SMALL_TEXT = dict(QWEN25_VL_3B_TEXT, vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]})  # fmt: skip
SMALL_VISION = dict(QWEN25_VL_3B_VISION, depth=2, hidden_size=128, intermediate_size=256, num_heads=2,
                    out_hidden_size=128, fullatt_block_indexes=[1])  # fmt: skip


def qwen25_vl_3b_config(token_ids: dict[str, int], small: bool = False):
    """A Qwen2_5_VLConfig with the 3B shapes (or the small stand-in) and our tokenizer's special ids."""
    from transformers import AutoConfig

    text, vision = (SMALL_TEXT, SMALL_VISION) if small else (QWEN25_VL_3B_TEXT, QWEN25_VL_3B_VISION)
    text = dict(text, bos_token_id=token_ids["<|endoftext|>"], eos_token_id=token_ids["<|im_end|>"],
                pad_token_id=token_ids["<|endoftext|>"])  # fmt: skip
    return AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=text,
        vision_config=dict(vision),
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=text["tie_word_embeddings"],
    )


def build_3b_shaped_model(
    out_dir: Path, device: torch.device, small: bool, seed: int = 0
) -> tuple[Path, int]:
    """Write the random-init model (bf16 weights, initialized on `device`: fast on a GPU) with the
    tiny processor into `out_dir`; returns (folder, parameter count)."""
    from transformers import AutoModelForImageTextToText

    from vlrl.models.tiny import SIZES, _token_ids, build_processor, build_tokenizer

    tokenizer = build_tokenizer(SIZES["tiny"].vocab)
    config = qwen25_vl_3b_config(_token_ids(tokenizer), small)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    del model
    build_processor("qwen2_5_vl", tokenizer, 28 * 28 * 4, 448 * 448).save_pretrained(out_dir)
    return out_dir, params


def _sizes(small: bool) -> dict[str, Any]:
    if small:
        return {"prompts": 4, "image": 56, "responses": [8, 5, 12, 3], "micro": 2, "timed": 1}
    # 16 rows, half with a 448x448 image (256 image tokens), responses 512-1024: ~14k tokens/update
    return {"prompts": 16, "image": 448, "responses": [1024, 768, 512, 896], "micro": 4, "timed": 2}


def check_qwen3b_update(ctx: Context, outcome: Outcome) -> None:
    from vlrl.models.flops import peak_flops, training_flops
    from vlrl.models.processor import load_processor
    from vlrl.workers.from_config import build_actor

    size = _sizes(ctx.small)
    t = time.perf_counter()
    model_dir, params = build_3b_shaped_model(
        ctx.workdir / "qwen25_vl_3b_shapes", ctx.device, ctx.small, ctx.seed
    )
    outcome.details["build_seconds"] = round(time.perf_counter() - t, 1)
    outcome.summary["params_b"] = round(params / 1e9, 3)
    n = size["prompts"]
    config = make_config(
        str(model_dir), ctx.device,
        **{"worker.actor.model.enable_gradient_checkpointing": True,
           "worker.actor.global_batch_size": n, "data.rollout_batch_size": n,
           "worker.actor.micro_batch_size_per_device_for_update": size["micro"],
           "worker.actor.micro_batch_size_per_device_for_experience": 2 * size["micro"],
           "worker.actor.optim.lr": 1e-6,
           "data.max_prompt_length": 1024, "data.max_response_length": max(size["responses"]),
           "data.max_pixels": size["image"] ** 2},
    )  # fmt: skip
    prompts = prompt_batch(str(model_dir), config.data, n, size["image"], ctx.seed)
    batch = training_fields(
        random_rollout(str(model_dir), prompts, 1, size["responses"], 1000, ctx.seed), ctx.seed
    )
    lengths = batch.attention_mask.sum(-1).tolist()
    outcome.details["batch"] = {"rows": len(batch), "tokens": sum(lengths),
                                "response_tokens": int(batch.response_mask.sum()),
                                "images": sum(len(i) for i in batch.images)}  # fmt: skip
    with single_rank_world(ctx.device):
        _, processor = load_processor(str(model_dir))
        t = time.perf_counter()
        actor = build_actor(config, processor, ctx.device, model_path=str(model_dir))
        outcome.details["load_seconds"] = round(time.perf_counter() - t, 1)
        phases = outcome.details["memory"] = {"load": memory(ctx.device)}  # per phase, peak reset after each
        t = time.perf_counter()
        batch.old_log_probs = actor_log_probs(actor, batch)
        sync(ctx.device)
        logp_s = time.perf_counter() - t
        phases["log_probs"] = memory(ctx.device)
        _reference_pass(ctx, config, processor, model_dir, batch, phases)
        actor.update_policy(batch)  # warm-up: allocator, optimizer states, kernels' first calls
        phases["warmup_update"] = memory(ctx.device)
        seconds, metrics = [], []
        for _ in range(size["timed"]):
            sync(ctx.device)
            t = time.perf_counter()
            metrics.append(actor.update_policy(batch))
            sync(ctx.device)
            seconds.append(time.perf_counter() - t)
        phases["timed_updates"] = memory(ctx.device)
        outcome.details["weight_sync"] = _sync_walk(actor, ctx, outcome)
        del actor
        _release(ctx.device)
        _lora_load(ctx, config, processor, model_dir, batch, outcome)
    update_s = min(seconds)
    flops = training_flops(config_of(model_dir), lengths, int(batch.response_mask.sum()))
    peak_flop_s = peak_flops(ctx.device)
    mfu = flops / update_s / peak_flop_s if peak_flop_s else None
    outcome.details.update(update_seconds=seconds, log_prob_seconds=logp_s, train_flops=flops,
                           peak_flop_s=peak_flop_s, actor_metrics=metrics)  # fmt: skip
    outcome.summary.update(tokens=sum(lengths), tokens_per_s=round(sum(lengths) / update_s, 1), mfu=mfu,
                           logp_tokens_per_s=round(sum(lengths) / logp_s, 1))  # fmt: skip
    if ctx.cuda:
        outcome.summary["peak_mib"] = max(p["peak_allocated_mib"] for p in phases.values())
        # P5 goal (issue 14): MFU >= 35% on an H100. Reported, not a failure: it is a target.
        outcome.summary["mfu_goal_35pct_met"] = mfu is not None and mfu >= MFU_GOAL
    if ctx.cuda:  # issue 31 finding 5: a no-grad pass must leave only the shards behind
        for before, after in (("load", "log_probs"), ("ref_load", "ref_log_probs")):
            grown = phases[after]["allocated_mib"] - phases[before]["allocated_mib"]
            outcome.expect(grown <= RETURN_MIB, f"{grown:.0f} MiB still allocated after {after} "
                           f"(more than {RETURN_MIB} MiB above {before}): gathered weights not freed")  # fmt: skip
    for m in metrics:
        outcome.expect(m["actor/grad_norm"] == m["actor/grad_norm"], f"NaN grad norm: {m['actor/grad_norm']}")
        outcome.expect(m["actor/skipped_steps"] == 0, "the optimizer skipped a step (non-finite gradient)")


def _release(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _reference_pass(ctx: Context, config, processor, model_dir: Path, batch, phases: dict) -> None:
    """The reference policy (bf16 on GPU) loaded and run once; memory after each; then freed."""
    from vlrl.workers.from_config import build_reference

    reference = build_reference(config, processor, ctx.device, model_path=str(model_dir))
    phases["ref_load"] = memory(ctx.device)
    reference.compute_log_probs(batch)
    phases["ref_log_probs"] = memory(ctx.device)
    del reference
    _release(ctx.device)


class _CountingEngine:
    """Stands in for a rollout engine in the weight-sync walk: counts what arrives, keeps nothing."""

    weight_dtype = torch.bfloat16

    def __init__(self) -> None:
        self.names: list[str] = []
        self.largest = 0  # bytes of the largest tensor

    def load_weights(self, named, bucket_mb=None, stats=None) -> None:
        from vlrl.rollout.weight_sync import bucketize

        for bucket in bucketize(named, bucket_mb or 512, self.weight_dtype, stats):
            for name, tensor in bucket:
                self.names.append(name)
                self.largest = max(self.largest, tensor.numel() * tensor.element_size())


def _sync_walk(actor, ctx: Context, outcome: Outcome) -> dict[str, Any]:
    """`sync_weights` of the trained actor into `_CountingEngine`: every name (the tied lm head too)
    arrives once, in bf16, with a peak of about one bucket and the largest tensor on top."""
    from vlrl.rollout.weight_sync import sync_weights, tied_aliases

    engine, bucket_mb = _CountingEngine(), 256
    metrics = sync_weights(actor.model.module, engine, bucket_mb)
    expected = list(actor.model.module.state_dict())
    largest_mib = engine.largest / 2**20
    out = {**metrics, "tensors": len(engine.names), "largest_mib": largest_mib,
           "tied": tied_aliases(actor.model.module)}  # fmt: skip
    outcome.summary["sync_s"] = round(metrics["sync/time_s"], 2)
    outcome.expect(
        sorted(engine.names) == sorted(expected), "the sync did not send every state_dict name once"
    )
    if ctx.cuda:
        bound = bucket_mb + 2 * largest_mib + 256
        outcome.summary["sync_peak_mib"] = round(metrics["sync/peak_extra_mb"], 1)
        outcome.expect(metrics["sync/peak_extra_mb"] <= bound,
                       f"weight sync peak {metrics['sync/peak_extra_mb']:.0f} MiB > {bound:.0f} "
                       "(one bucket + twice the largest tensor + 256)")  # fmt: skip
    return out


def _lora_load(ctx: Context, config, processor, model_dir: Path, batch, outcome: Outcome) -> None:
    """A LoRA actor of the same model: base in the compute dtype on GPU (half the memory of the
    fp32 actor), adapters fp32; one update runs."""
    from dataclasses import replace

    from vlrl.workers.from_config import build_actor

    lora = replace(config.worker.actor.model.lora, rank=16, alpha=32, target_modules="all-linear")
    config.worker.actor.model.lora = lora
    actor = build_actor(config, processor, ctx.device, model_path=str(model_dir))
    loaded = memory(ctx.device)
    dtypes = {"trained": sorted({str(p.dtype) for p in actor.model.module.parameters() if p.requires_grad}),
              "frozen": sorted({str(p.dtype) for p in actor.model.module.parameters() if not p.requires_grad})}  # fmt: skip
    metrics = actor.update_policy(batch)
    outcome.details["lora"] = {"memory_load": loaded, "dtypes": dtypes, "memory_update": memory(ctx.device),
                               "grad_norm": metrics["actor/grad_norm"]}  # fmt: skip
    outcome.expect(
        dtypes["trained"] == [str(torch.float32)], f"LoRA adapters in {dtypes['trained']}, not fp32"
    )
    outcome.expect(metrics["actor/grad_norm"] == metrics["actor/grad_norm"], "LoRA update: NaN grad norm")
    if ctx.cuda:
        full = outcome.details["memory"]["load"]["allocated_mib"]
        outcome.summary["lora_load_mib"] = loaded["allocated_mib"]
        outcome.expect(
            dtypes["frozen"] == [str(torch.bfloat16)], f"LoRA base in {dtypes['frozen']}, not bf16"
        )
        outcome.expect(loaded["allocated_mib"] <= 0.6 * full,
                       f"LoRA actor holds {loaded['allocated_mib']:.0f} MiB, more than 0.6x the fp32 actor's {full:.0f}")  # fmt: skip
    del actor
    _release(ctx.device)


def config_of(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))
