"""Actor training throughput, padded vs packed (padding-free), and MFU, on one rank.

    .venv/bin/python benchmarks/bench_actor.py                      # `small` tiny Qwen2.5-VL, CPU
    .venv/bin/python benchmarks/bench_actor.py --samples 32 --steps 3 --model-dir DIR

A batch of variable-length samples (a quarter with an image, prompts of 20-80 text tokens,
response lengths drawn from a long-tailed distribution up to --max-response) is trained with
`Actor.update_policy` in each mode; every mode sees the same batch and the same micro-batch size.
Tokens/s counts real (non-padding) prompt + response tokens; the modes' updates are interleaved
and the median reported, because these CPUs are shared (use --threads 1 for stable numbers). MFU counts the decoder's model FLOPs
of the real tokens (vlrl.models.flops: vision tower not counted) against the peak: on CPU a
measured fp32 matmul rate of this process, on GPU the bf16 table value.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from PIL import Image
from transformers import AutoConfig

from vlrl.batch.rows import RolloutBatch
from vlrl.config import PPOConfig
from vlrl.models.families import family_of
from vlrl.models.flops import measured_cpu_peak, peak_flops, training_flops
from vlrl.models.processor import load_processor
from vlrl.models.rope import continue_position_ids, left_pad_position_ids, mrope_position_ids
from vlrl.workers.actor import Actor
from vlrl.workers.from_config import build_actor as actor_from_config


def make_config(model_dir: str, padding_free: bool, micro: int, device: str) -> PPOConfig:
    config = PPOConfig()
    actor = config.worker.actor
    actor.model.model_path = model_dir
    actor.model.enable_gradient_checkpointing = False
    actor.padding_free = padding_free
    actor.micro_batch_size_per_device_for_update = micro
    actor.global_batch_size = 10**6  # one optimizer step per update: all rows in one mini-batch
    actor.optim.lr = 1e-5
    config.worker.rollout.n = 1
    config.trainer.n_gpus_per_node = 1
    config.trainer.device = device
    config.derive()
    return config


def make_batch(model_dir: str, samples: int, max_response: int, seed: int) -> RolloutBatch:
    """Variable-length image/text prompts with random long-tailed responses."""
    rng = random.Random(seed)
    tokenizer, processor = load_processor(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    family, vc = family_of(config).vision_scheme, config.vision_config
    factor = processor.image_processor.patch_size * processor.image_processor.merge_size
    prompts, positions, images, responses = [], [], [], []
    for i in range(samples):
        text = " ".join(
            rng.choice(["what", "colour", "shape", "count", "answer", "the"])
            for _ in range(rng.randint(20, 80))
        )
        imgs = (
            [Image.new("RGB", (factor * rng.randint(2, 4), factor * rng.randint(2, 4)))] if i % 4 == 0 else []
        )
        content = [{"type": "image"}] * len(imgs) + [{"type": "text", "text": text}]
        rendered = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        out = processor(text=[rendered], images=imgs or None, return_tensors="pt")
        ids = out["input_ids"][0]
        pos = mrope_position_ids(
            ids, out.get("image_grid_thw"), None, image_token_id=config.image_token_id,
            video_token_id=config.video_token_id, vision_start_token_id=config.vision_start_token_id,
            spatial_merge_size=vc.spatial_merge_size, tokens_per_second=getattr(vc, "tokens_per_second", 2.0),
            family=family,
        )  # fmt: skip
        length = min(max_response, max(4, int(rng.paretovariate(1.2) * 16)))
        prompts.append(ids)
        positions.append(pos)
        images.append(imgs)
        responses.append(torch.randint(0, tokenizer.pad_token_id, (length,)))
    p_len, r_len = max(p.numel() for p in prompts), max(r.numel() for r in responses)
    pad = tokenizer.pad_token_id
    ids = torch.full((samples, p_len + r_len), pad)
    mask = torch.zeros(samples, p_len + r_len, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, p_len - p.numel() : p_len + r.numel()] = torch.cat([p, r])
        mask[i, p_len - p.numel() : p_len + r.numel()] = 1
    prompt_pos = left_pad_position_ids(positions, p_len)
    resp_mask = mask[:, p_len:]
    return RolloutBatch(
        input_ids=ids,
        attention_mask=mask,
        position_ids=torch.cat([prompt_pos, continue_position_ids(prompt_pos, r_len)], -1),
        responses=ids[:, p_len:],
        response_mask=resp_mask,
        group_ids=torch.arange(samples),
        prompt_length=p_len,
        images=images,
        prompts=[""] * samples,
        ground_truths=[None] * samples,
        extras=[{} for _ in range(samples)],
        old_log_probs=torch.full((samples, r_len), -9.0),
        advantages=torch.randn(samples, 1).sign() * resp_mask,
    )


def build_actor(model_dir: str, args, padding_free: bool, backend: str) -> Actor:
    _, processor = load_processor(model_dir)
    config = make_config(model_dir, padding_free, args.micro, args.device)
    actor = actor_from_config(config, processor, args.device, model_path=model_dir)
    actor.model.attention_backend = backend
    return actor


def time_modes(actors: dict[str, Actor], batch: RolloutBatch, steps: int) -> dict[str, float]:
    """Median seconds per update of each actor; modes interleaved so load drifts hit all alike."""
    for actor in actors.values():
        actor.update_policy(batch)  # warm-up (allocator, caches)
    times: dict[str, list[float]] = {name: [] for name in actors}
    for _ in range(steps):
        for name, actor in actors.items():
            start = time.perf_counter()
            actor.update_policy(batch)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir", default=None, help="model folder; default: build the `small` tiny model"
    )
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-response", type=int, default=384)
    parser.add_argument("--micro", type=int, default=4, help="micro-batch size (samples)")
    parser.add_argument("--steps", type=int, default=3, help="timed updates per mode (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=0, world_size=1)
    model_dir = args.model_dir
    if model_dir is None:
        from vlrl.models.tiny import build_tiny_model

        model_dir = str(build_tiny_model(tempfile.mkdtemp(prefix="bench_actor_"), "qwen2_5_vl", size="small"))
    batch = make_batch(model_dir, args.samples, args.max_response, seed=0)
    real = int(batch.attention_mask.sum())
    print(f"batch: {args.samples} samples, width {batch.input_ids.shape[1]}, real tokens {real} "
          f"({real / batch.attention_mask.numel():.0%} of the padded area), threads {torch.get_num_threads()}")  # fmt: skip
    if args.device == "cpu":
        print(f"measured CPU fp32 matmul peak: {measured_cpu_peak() / 1e9:.1f} GFLOP/s")
    modes = {
        "padded": (False, "auto"),
        "packed, loop attention": (True, "loop"),
        "packed, mask attention": (True, "mask"),
    }
    actors = {name: build_actor(model_dir, args, pf, backend) for name, (pf, backend) in modes.items()}
    seconds = time_modes(actors, batch, args.steps)
    lengths = batch.attention_mask.sum(-1).tolist()
    flops = training_flops(next(iter(actors.values())).hf_config, lengths)
    peak = peak_flops(args.device) or float("nan")
    base = seconds["padded"]
    print("\n| mode | train tokens/s | s/update | speed vs padded | MFU |\n|---|---|---|---|---|")
    for name, sec in seconds.items():
        print(f"| {name} | {real / sec:.0f} | {sec:.2f} | {base / sec:.2f}x | {flops / sec / peak:.1%} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
