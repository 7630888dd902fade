"""Helpers shared by the actor tests (in-process and spawned ranks): configs, gloo process groups
and `RolloutBatch`es built from a tiny model folder (mixed image/text prompts, random responses)."""

from __future__ import annotations

import datetime
import os
import random
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from PIL import Image
from transformers import AutoConfig

from vlrl.batch.rows import RolloutBatch
from vlrl.config import PPOConfig
from vlrl.models.families import family_of
from vlrl.models.processor import load_processor
from vlrl.models.rope import continue_position_ids, left_pad_position_ids, mrope_position_ids
from vlrl.models.sampling import SamplingDistribution, banned_token_ids

WORDS = (
    "what",
    "colour",
    "is",
    "the",
    "shape",
    "how",
    "many",
    "circles",
    "are",
    "there",
    "answer",
    "one",
    "word",
)


def _image(rng: random.Random, factor: int) -> Image.Image:
    w, h = factor * rng.choice([2, 3]), factor * rng.choice([2, 3])
    return Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))


def make_batch(
    model_dir: str,
    specs: list[tuple[bool | int, int]],
    group_size: int = 1,
    seed: int = 0,
) -> RolloutBatch:
    """One prompt per spec (with an image or not, or a number of images; response length), each
    repeated `group_size` times.

    Prompts have different lengths (left-padded), responses different lengths (right-padded with
    pad after an EOS). Samples of one group share their image objects, like a real rollout.
    """
    rng = random.Random(seed)
    tokenizer, processor = load_processor(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    family = family_of(config).vision_scheme
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts, positions, images, responses = [], [], [], []
    for with_image, resp_len in specs:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
        content = [{"type": "image"}] * int(with_image) + [{"type": "text", "text": text}]
        messages = [{"role": "user", "content": content}]
        if processor is not None:
            rendered = processor.apply_chat_template(messages, add_generation_prompt=True)
            ip = processor.image_processor
            imgs = [_image(rng, ip.patch_size * ip.merge_size) for _ in range(int(with_image))]
            out = processor(text=[rendered], images=imgs or None, return_tensors="pt")
            ids = out["input_ids"][0]
            grid = out.get("image_grid_thw")
            pos = mrope_position_ids(
                ids, grid, None,
                image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                vision_start_token_id=config.vision_start_token_id,
                spatial_merge_size=config.vision_config.spatial_merge_size,
                tokens_per_second=getattr(config.vision_config, "tokens_per_second", 2.0),
                family=family,
            )  # fmt: skip
        else:
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = torch.tensor(tokenizer(rendered)["input_ids"])
            imgs, pos = [], torch.arange(ids.numel())
        body = [rng.randrange(0, pad) for _ in range(max(resp_len - 1, 0))]
        for _ in range(group_size):
            prompts.append(ids)
            positions.append(pos)
            images.append(imgs)
            responses.append(torch.tensor([rng.randrange(0, pad) for _ in body] + [eos])[:resp_len])
    n = len(prompts)
    p_len = max(p.numel() for p in prompts)
    r_len = max(r.numel() for r in responses)
    prompt_ids = torch.full((n, p_len), pad, dtype=torch.long)
    prompt_mask = torch.zeros(n, p_len, dtype=torch.long)
    resp_ids = torch.full((n, r_len), pad, dtype=torch.long)
    resp_mask = torch.zeros(n, r_len, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        prompt_ids[i, p_len - p.numel() :] = p
        prompt_mask[i, p_len - p.numel() :] = 1
        resp_ids[i, : r.numel()] = r
        resp_mask[i, : r.numel()] = 1
    prompt_pos = left_pad_position_ids(positions, p_len)
    pos = torch.cat([prompt_pos, continue_position_ids(prompt_pos, r_len)], dim=-1)
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, resp_ids], 1),
        attention_mask=torch.cat([prompt_mask, resp_mask], 1),
        position_ids=pos,
        responses=resp_ids,
        response_mask=resp_mask,
        group_ids=torch.arange(n) // group_size,
        prompt_length=p_len,
        images=images,
        prompts=["p"] * n,
        ground_truths=[None] * n,
        extras=[{} for _ in range(n)],
    )


def sampling_for(model_dir: str, temperature: float = 1.0) -> SamplingDistribution:
    """The engines' sampling distribution for the model in `model_dir` (what the actor scores)."""
    tokenizer, _ = load_processor(model_dir)
    return SamplingDistribution(
        temperature, tuple(banned_token_ids(tokenizer, AutoConfig.from_pretrained(model_dir)))
    )


def make_config(model_dir: str, world_size: int = 1, **overrides: Any) -> PPOConfig:
    """A small PPOConfig for the tiny model; `overrides` are dotted keys with '__' for dots."""
    config = PPOConfig()
    values = {
        "worker.actor.model.model_path": model_dir,
        "worker.actor.model.enable_gradient_checkpointing": False,
        "worker.actor.optim.lr": 1e-3,
        "worker.actor.optim.weight_decay": 0.0,
        "worker.actor.global_batch_size": 8,
        "worker.actor.micro_batch_size_per_device_for_update": 2,
        "worker.actor.micro_batch_size_per_device_for_experience": 4,
        "worker.actor.max_grad_norm": 1e9,
        "worker.rollout.n": 1,
        "data.rollout_batch_size": 8,
        "data.max_prompt_length": 64,
        "data.max_response_length": 16,
        "trainer.nnodes": 1,
        "trainer.n_gpus_per_node": world_size,
        "trainer.device": "cpu",
    }
    values.update({k.replace("__", "."): v for k, v in overrides.items()})
    for key, value in values.items():
        *path, last = key.split(".")
        node = config
        for name in path:
            node = getattr(node, name)
        setattr(node, last, value)
    config.derive()
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int) -> None:
    """Join a gloo group on localhost; a stuck collective fails after 2 minutes instead of hanging."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))


def forked_child_can_backward() -> bool:
    """Whether a child forked now can run autograd. Once this process has run any backward, torch
    marks every later fork child as unable to ("Unable to handle autograd's threading in combination
    with fork-based multiprocessing": torch/csrc/autograd/engine.cpp, `track_bad_autograd_forks`),
    and nothing public says so: a forked probe that runs one tiny backward tells (a few ms)."""
    pid = os.fork()
    if pid == 0:  # the probe: exit 0 when a backward works here
        code = 1
        try:
            torch.ones(1, requires_grad=True).sum().backward()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def launch(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run `fn(rank, world_size, port, *args)` in `world_size` processes and wait for them.

    Forks when it is safe (Linux, no process group or CUDA in this process, and a forked child can
    still run a backward): the children inherit the imported modules, which saves ~15 s of imports
    per rank on these CPUs. Otherwise spawns.
    """
    import sys

    import torch.multiprocessing as mp

    safe = sys.platform == "linux" and not dist.is_initialized() and not torch.cuda.is_initialized()
    method = "fork" if safe and forked_child_can_backward() else "spawn"
    mp.start_processes(fn, args=(world_size, free_port(), *args), nprocs=world_size, start_method=method)


def with_training_fields(batch: RolloutBatch, seed: int = 0, kl: bool = False) -> RolloutBatch:
    """Fill old_log_probs (a perturbation of 0), advantages (per group, +-1) and ref_log_probs."""
    gen = torch.Generator().manual_seed(seed)
    n, r = batch.responses.shape
    adv = (torch.rand(n, generator=gen) - 0.5).sign()[:, None].expand(n, r).contiguous()
    batch.advantages = adv * batch.response_mask
    batch.old_log_probs = torch.zeros(n, r)
    if kl:
        batch.ref_log_probs = torch.zeros(n, r)
    return batch
