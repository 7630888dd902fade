"""Rollout: sample n responses per prompt with vLLM (SPMD, one engine per rank) or transformers.

    engine = create_rollout_engine(config.worker.rollout, config.data, model_path, tokenizer, processor)
    metrics = sync_weights(actor_module, engine, config.worker.rollout.sync_bucket_mb)
    batch = engine.generate(prompt_batch, overrides)  # RolloutBatch

See docs/rollout.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlrl.rollout.base import NoWeightsError, RolloutEngine, SamplingSettings, resolve_sampling
    from vlrl.rollout.output import assemble_rollout_batch, response_mask_from_eos
    from vlrl.rollout.weight_sync import checkpoint_name, sync_weights

# Imported on first use (PEP 562), so the tool worker processes of vlrl.rollout.multi_turn, which
# import this package, start without torch (~0.2 s instead of ~3.5 s per process).
_LAZY = {
    "NoWeightsError": "vlrl.rollout.base",
    "RolloutEngine": "vlrl.rollout.base",
    "SamplingSettings": "vlrl.rollout.base",
    "resolve_sampling": "vlrl.rollout.base",
    "assemble_rollout_batch": "vlrl.rollout.output",
    "response_mask_from_eos": "vlrl.rollout.output",
    "checkpoint_name": "vlrl.rollout.weight_sync",
    "sync_weights": "vlrl.rollout.weight_sync",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vlrl.rollout' has no attribute {name!r}")


__all__ = [
    "NoWeightsError",
    "RolloutEngine",
    "SamplingSettings",
    "assemble_rollout_batch",
    "checkpoint_name",
    "create_rollout_engine",
    "resolve_sampling",
    "response_mask_from_eos",
    "sync_weights",
]


def create_rollout_engine(
    config: Any,
    data_config: Any,
    model_path: str,
    tokenizer: Any,
    processor: Any | None = None,
    limit_images: int | None = None,
    limit_videos: int = 0,
    rollout_only: bool = False,
) -> RolloutEngine:
    """The engine `config.name` names (vllm | hf) for this rank.

    `limit_images`: the most images a prompt of the data has (used when `config.limit_images` is 0);
    `limit_videos`: the most videos (the HF engine takes none); `rollout_only`: the rank only
    generates (asynchronous mode): a vLLM engine then never sleeps and takes more GPU memory.
    The vLLM engine needs an initialized torch.distributed world (one rank is fine).
    """
    if config.name == "vllm":
        from vlrl.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(
            config, data_config, model_path, tokenizer, processor, limit_images, limit_videos, rollout_only
        )
    if config.name == "hf":
        from vlrl.rollout.hf_engine import HFRolloutEngine

        if limit_videos:  # the trainer refuses this before the ranks start (check_data_media)
            raise ValueError(
                "the data has videos, which only the vLLM engine takes: set worker.rollout.name=vllm"
            )

        return HFRolloutEngine(config, data_config, model_path, tokenizer, processor, limit_images)
    raise ValueError(f"worker.rollout.name={config.name!r} is unknown; choose vllm or hf")
