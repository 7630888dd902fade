"""Helpers shared by the rollout tests (in-process and spawned ranks): prompt batches, worlds, models."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

from vlrl.batch.rows import PromptBatch, RolloutBatch
from vlrl.config import DataConfig, RolloutConfig

# Tiny images: 4-16 merged 28x28 blocks each (qwen3_vl's 32x32 blocks scale the same bounds).
PIXELS = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}


def data_config(max_response_length: int = 12, **kwargs: Any) -> DataConfig:
    kwargs.setdefault("prompt_key", "problem")
    return DataConfig(max_prompt_length=256, max_response_length=max_response_length, **PIXELS, **kwargs)


def rollout_config(**kwargs: Any) -> RolloutConfig:
    """A small CPU engine: fp32 (so vLLM and transformers agree token for token), few sequences."""
    values = dict(dtype="fp32", gpu_memory_utilization=0.2, n=2, max_num_seqs=32, sync_bucket_mb=1)
    values.update(kwargs)
    return RolloutConfig(**values)


def image(seed: int, height: int = 60, width: int = 90) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


ROWS = [
    {"problem": "<image> what colour is the shape", "answer": "red", "images": [image(0)]},
    {"problem": "<image> and <image> how many shapes", "answer": "2", "images": [image(1, 56, 56), image(2)]},
    {"problem": "1 + 2 =", "answer": "3", "images": []},
]


def prompt_batch(
    model_dir: str, rows: list[dict[str, Any]] | None = None, uid_start: int = 100
) -> PromptBatch:
    """A PromptBatch built by the real data pipeline (chat template, resize, expansion, mrope)."""
    from transformers import AutoConfig

    from vlrl.data.collate import collate_prompts
    from vlrl.data.prepare import RowPreparer
    from vlrl.models.processor import load_processor

    tokenizer, processor = load_processor(model_dir)
    rows = ROWS if rows is None else rows
    if processor is None:  # text model: drop the images and their markers
        rows = [{**r, "problem": r["problem"].replace("<image>", "").strip(), "images": []} for r in rows]
    preparer = RowPreparer(data_config(), tokenizer, processor, AutoConfig.from_pretrained(model_dir))
    samples = [preparer.sample(row, "", uid_start + i, use_processor=True) for i, row in enumerate(rows)]
    return collate_prompts(samples, tokenizer.pad_token_id)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(rank: int, world_size: int, port: int) -> None:
    """A gloo world on localhost with the env vars vLLM's external_launcher reads."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=180))


def close_world() -> None:
    """Tear down vLLM's groups and the torch world so later tests start clean."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()


def load_hf_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    cls = (
        AutoModelForImageTextToText
        if getattr(config, "vision_config", None) is not None
        else AutoModelForCausalLM
    )
    return cls.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int, scale: float = 0.5) -> None:
    """Add noise to every parameter (a stand-in for an optimizer step)."""
    gen = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.add_(torch.randn(param.shape, generator=gen) * scale * param.float().std().clamp(min=1e-3))


@torch.no_grad()
def make_token_argmax(model: torch.nn.Module, token_id: int) -> None:
    """Make `token_id` the argmax after every prefix, by a wide margin.

    Hidden dimension 0 of every token embedding gets a large constant, so the residual stream (and
    the final RMSNorm output) is large and positive there whatever the context; only `token_id`'s
    lm_head row reads that dimension.
    """
    model.get_input_embeddings().weight[:, 0] = 100.0  # [V, H]
    head = model.get_output_embeddings().weight  # [V, H]
    head[:, 0] = 0.0
    head[token_id, 0] = 50.0


def greedy_hf_batch(
    model_dir: str, model: torch.nn.Module, prompts: PromptBatch, max_tokens: int
) -> RolloutBatch:
    """transformers' greedy rollout of `prompts` (with log-probs), through our HF engine's input path."""
    from vlrl.models.processor import load_processor
    from vlrl.rollout.hf_engine import HFRolloutEngine

    tokenizer, processor = load_processor(model_dir)
    config = rollout_config(name="hf", calculate_log_probs=True)
    engine = HFRolloutEngine(config, data_config(max_tokens), model_dir, tokenizer, processor)
    engine.model = model
    return engine.generate(prompts, {"temperature": 0.0, "n": 1})


def greedy_hf(model_dir: str, model: torch.nn.Module, prompts: PromptBatch, max_tokens: int) -> torch.Tensor:
    """transformers' greedy responses ([B, R]) for `prompts`."""
    return greedy_hf_batch(model_dir, model, prompts, max_tokens).responses


def save_model(model: torch.nn.Module, source_dir: str, out_dir: str) -> str:
    """`model` saved as a model folder, with the tokenizer/processor of `source_dir`."""
    from vlrl.models.processor import load_processor

    tokenizer, processor = load_processor(source_dir)
    model.save_pretrained(out_dir)
    (processor or tokenizer).save_pretrained(out_dir)
    return out_dir


def one_rank_actor(model_dir: str, temperature: float) -> Any:
    """An `Actor` (FSDP2 over the current one-rank world, fp32 on CPU) for `model_dir`."""
    from vlrl.config import PPOConfig
    from vlrl.models.processor import load_processor
    from vlrl.workers.from_config import build_actor

    config = PPOConfig()
    config.worker.actor.model.model_path = model_dir
    config.worker.actor.model.enable_gradient_checkpointing = False
    config.worker.rollout.temperature = temperature
    config.trainer.device = "cpu"
    config.data.max_prompt_length, config.data.max_response_length = 256, 12
    config.derive()
    return build_actor(config, load_processor(model_dir)[1], "cpu", model_path=model_dir)


@torch.no_grad()
def masked_entropy(
    model: torch.nn.Module, model_dir: str, batch: RolloutBatch, banned: list[int], temperature: float
) -> torch.Tensor:
    """[N, R] entropy of softmax(logits with `banned` at -inf / T) from a plain padded forward."""
    from vlrl.models.packing import build_padded_inputs
    from vlrl.models.processor import load_processor
    from vlrl.workers.vision import VisionCache

    pv = grid = None
    if any(batch.images):
        pv, grid = VisionCache(load_processor(model_dir)[1].image_processor).collate(batch.images)
    args = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_length)
    inputs = build_padded_inputs(*args, pixel_values=pv, image_grid_thw=grid)
    logits = model(**inputs.model_kwargs, use_cache=False).logits[inputs.rows, inputs.cols].double()
    logits[:, banned] = float("-inf")
    entropy = torch.zeros(batch.responses.shape, dtype=torch.float64)
    entropy[inputs.rows, inputs.cols] = torch.distributions.Categorical(logits=logits / temperature).entropy()
    return entropy


@contextlib.contextmanager
def one_rank_engine(model_dir: str, **rollout_kwargs: Any) -> Iterator[Any]:
    """A vLLM engine for `model_dir` in a one-rank gloo world; afterwards the engine, the world and
    `torch.set_num_threads` (vLLM's CPU worker replaces it process-wide) are put back."""
    from vlrl.models.processor import load_processor
    from vlrl.rollout import create_rollout_engine

    set_num_threads = torch.set_num_threads
    init_world(0, 1, free_port())
    tokenizer, processor = load_processor(model_dir)
    engine = create_rollout_engine(
        rollout_config(**rollout_kwargs), data_config(), model_dir, tokenizer, processor
    )
    try:
        yield engine
    finally:
        engine.close()
        close_world()
        torch.set_num_threads = set_num_threads
