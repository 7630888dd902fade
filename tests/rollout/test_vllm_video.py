"""Video on the rollout path (vLLM, real engine on CPU) and in the actor: the actor's log-probs of
what vLLM sampled from prompts with videos equal vLLM's own, packed and padded, per architecture."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from PIL import Image
from rollout_helpers import (
    close_world,
    data_config,
    free_port,
    image,
    init_world,
    load_hf_model,
    one_rank_actor,
    prompt_batch,
    rollout_config,
)

from vlrl.models.processor import load_processor
from vlrl.rollout import create_rollout_engine, sync_weights

COLOURS = ["red", "green", "blue", "yellow", "white", "black"]


def frames(start: int, count: int, size: int = 56) -> list[Image.Image]:
    return [Image.new("RGB", (size, size), COLOURS[(start + k) % len(COLOURS)]) for k in range(count)]


ROWS = [
    {"problem": "<video> which way does it move", "answer": "left", "videos": [frames(0, 4)]},
    {
        "problem": "<image> then <video> same?",
        "answer": "yes",
        "images": [image(3)],
        "videos": [frames(2, 3, 84)],
    },
    {"problem": "1 + 2 =", "answer": "3"},
]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_actor_log_probs_match_vllm_on_videos(tiny_model, arch):
    path = tiny_model(arch)
    init_world(0, 1, free_port())
    try:
        tokenizer, processor = load_processor(path)
        engine = create_rollout_engine(
            rollout_config(calculate_log_probs=True), data_config(), path, tokenizer, processor,
            limit_images=1, limit_videos=1,
        )  # fmt: skip
        sync_weights(load_hf_model(path), engine, bucket_mb=1)
        prompts = prompt_batch(path, ROWS)
        assert [len(v) for v in prompts.videos] == [1, 1, 0]
        temperature = 0.8
        batch = engine.generate(prompts, {"seed": 3, "temperature": temperature, "n": 2})
        assert batch.videos[0][0] is batch.videos[1][0]  # a group shares its video object
        mask = batch.response_mask.bool()
        actor = one_rank_actor(path, temperature)
        packed = actor.compute_log_probs(batch)
        torch.testing.assert_close(packed[mask], batch.rollout_log_probs[mask], atol=2e-4, rtol=0)
        actor.model.spec = replace(actor.model.spec, padding_free=False)
        padded = actor.compute_log_probs(batch)
        torch.testing.assert_close(padded[mask], packed[mask], atol=2e-5, rtol=0)
        engine.close()
    finally:
        close_world()


def test_engine_video_pixels_equal_the_actors(tiny_model):
    """The normalised video pixels entering vLLM's vision tower equal the actor's
    `pixel_values_videos`. The tiny Qwen3-VL's image processor (CLIP mean/std) and video processor
    (0.5/0.5) normalise differently; vLLM's on-device normalisation would apply the image values to
    videos (max error ~1.1, log-prob gaps ~0.05), so the engine turns it off
    (`vllm_hooks.device_normalization_ok`)."""
    from vlrl.rollout import vllm_hooks
    from vlrl.workers.vision import VisionCache

    path = tiny_model("qwen3_vl")
    tokenizer, processor = load_processor(path)
    assert not vllm_hooks.device_normalization_ok(processor)
    init_world(0, 1, free_port())
    try:
        engine = create_rollout_engine(
            rollout_config(), data_config(), path, tokenizer, processor, limit_images=1, limit_videos=1
        )
        assert not engine.device_normalize
        sync_weights(load_hf_model(path), engine, bucket_mb=1)
        seen: list[torch.Tensor] = []

        def hook(worker):  # in-process engine: the hook appends to this test's list
            norm = worker.model_runner.model.visual.input_norm
            return norm.register_forward_hook(lambda module, args, out: seen.append(out.detach().clone()))

        (handle,) = engine.llm.collective_rpc(hook)
        prompts = prompt_batch(path, ROWS[:1])
        engine.generate(prompts, {"seed": 0, "temperature": 1.0, "n": 1, "max_tokens": 1})
        handle.remove()
        engine.close()
    finally:
        close_world()
    pixels, _ = VisionCache(
        processor.image_processor, video_processor=processor.video_processor
    ).sample_videos(prompts.videos[0])
    assert len(seen) == 1 and seen[0].shape == pixels.shape
    torch.testing.assert_close(seen[0], pixels, atol=1e-6, rtol=0)
