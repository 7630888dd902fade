"""The per-rank Ray actor: one process holding an actor shard (FSDP2), a rollout engine (vLLM SPMD
or HF) and, when KL is on, a reference policy. The driver calls one method per phase of a step.

Each method runs on every rank at once (the driver sends one shard per rank), because the
FSDP all-gathers and the weight sync are collectives: a rank that skipped a call would hang the others.
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING, Any

import torch

from vlrl.config import PPOConfig
from vlrl.protocol import PromptBatch, RolloutBatch

if TYPE_CHECKING:
    from vlrl.rollout.base import RolloutEngine
    from vlrl.workers.actor import Actor
    from vlrl.workers.reference import AdapterOffReference, Reference


class RankWorker:
    """Wrapped with `ray.remote` by the trainer (see `vlrl.trainer.workers.start_rank_workers`)."""

    def __init__(
        self, config: PPOConfig, rank: int, world_size: int, master_addr: str, master_port: int
    ) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size
        _init_process_group(
            config.trainer.device, rank, world_size, master_addr, master_port,
            timeout=datetime.timedelta(minutes=config.trainer.dist_timeout_minutes),
        )  # fmt: skip
        self.device = torch.device(
            f"cuda:{torch.cuda.current_device()}" if config.trainer.device == "cuda" else "cpu"
        )
        # built by setup(), which the driver calls once the world is up
        self.actor: Actor
        self.rollout: RolloutEngine
        self.reference: Reference | AdapterOffReference | None = None

    def setup(self, limit_images: int, optimizer_steps: int, limit_videos: int = 0) -> dict[str, float]:
        """Load the models and the engine, then give the engine the actor's weights.

        `limit_images` / `limit_videos`: most images / videos in one prompt of the data;
        `optimizer_steps`: of the whole run (for the LR schedule)."""
        from vlrl.models.processor import load_processor
        from vlrl.rollout import create_rollout_engine
        from vlrl.workers.actor import Actor
        from vlrl.workers.reference import AdapterOffReference, Reference

        model = self.config.worker.actor.model
        tokenizer, processor = load_processor(
            model.tokenizer_path or model.model_path, self.config.data.override_chat_template
        )
        self.actor = Actor(self.config, model.model_path, processor, self.device, total_steps=optimizer_steps)
        if self.config.use_reference and model.lora.rank > 0:
            # the actor's base weights with the adapters off: no second copy of the model
            self.reference = AdapterOffReference(
                self.actor, self.config.worker.ref.micro_batch_size_per_device_for_experience
            )
        elif self.config.use_reference:
            # shares the actor's per-step cache of image tensors: each image is processed once
            self.reference = Reference(
                self.config, model.model_path, processor, self.device, vision_cache=self.actor.vision
            )
        self.rollout = create_rollout_engine(
            self.config.worker.rollout, self.config.data, model.model_path, tokenizer, processor,
            limit_images=limit_images, limit_videos=limit_videos,
        )  # fmt: skip
        if tuple(self.rollout.banned_token_ids) != self.actor.banned_token_ids:
            raise RuntimeError(
                f"the rollout engine bans tokens {self.rollout.banned_token_ids} but the actor scores a "
                f"distribution without {self.actor.banned_token_ids}: they must sample and score the same "
                "policy (vlrl.models.sampling); check worker.actor.model.tokenizer_path"
            )
        return self.sync_weights()

    # ------------------------------------------------------------------------- step phases
    def generate(self, prompts: PromptBatch, overrides: dict[str, Any] | None = None) -> RolloutBatch:
        """Sample responses for this rank's prompts (its data-parallel shard).

        The actor's shards leave the GPU first (`worker.actor.offload`) and the allocator's cached
        blocks are released, so the engine can wake into that memory; they come back afterwards."""
        self.actor.offload_to_cpu()
        _release_cached_memory(self.device)
        try:
            self.rollout.wake_up()
            batch = self.rollout.generate(prompts, overrides)
            self.rollout.sleep()
        finally:
            self.actor.load_to_device()
        return batch

    def compute_log_probs(
        self, batch: RolloutBatch, with_old: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Old-policy (unless not `with_old`) and (when KL is on) reference log-probs: [N, R] or None."""
        temperature = self.config.worker.rollout.temperature
        old = self.actor.compute_log_probs(batch, temperature) if with_old else None
        ref = self.reference.compute_log_probs(batch, temperature) if self.reference is not None else None
        return old, ref

    def update(self, batch: RolloutBatch) -> tuple[dict[str, float], torch.Tensor | None]:
        """One PPO update on this rank's shard, then push the new weights to the engine.

        Returns the metrics and the old log-probs [N, R] (computed by the update itself when the
        batch came without them: `config.on_policy_update`)."""
        metrics = self.actor.update_policy(batch)
        metrics.update(self.sync_weights())
        return metrics, batch.old_log_probs

    def sync_weights(self) -> dict[str, float]:
        from vlrl.rollout import sync_weights

        return sync_weights(self.actor.module, self.rollout, self.config.worker.rollout.sync_bucket_mb)

    # ------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str, model_only: bool) -> None:
        """Sharded actor state + the config/processor (for `vlrl.tools.model_merger`) written by rank 0;
        with `model_only`, just a Hugging Face folder of the weights (not resumable)."""
        if model_only:
            self.actor.save_hf(os.path.join(path, "huggingface"))
            return
        self.actor.save_checkpoint(path)
        if self.rank == 0:
            self.actor.hf_config.save_pretrained(os.path.join(path, "hf_config"))
            self.actor.tokenizer_or_processor().save_pretrained(os.path.join(path, "hf_config"))
            self.actor.save_adapter_config(os.path.join(path, "hf_config"))

    def load_checkpoint(self, path: str) -> dict[str, float]:
        self.actor.load_checkpoint(path)
        return self.sync_weights()

    def probe_shared_path(self, marker: str, token: str) -> tuple[bool, str]:
        """Whether this rank sees the driver's checkpoint folder (`check_shared_filesystem`)."""
        from vlrl.trainer.checkpoint import probe_shared_path

        return probe_shared_path(marker, token, self.rank)

    def shutdown(self) -> None:
        if self.rollout is not None:
            self.rollout.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def process_group_backend(device: str) -> str:
    """The default group's backends: NCCL for CUDA tensors and, on GPU, gloo for CPU tensors.

    FSDP2's CPU offload (`fsdp.enable_cpu_offload`) keeps the sharded parameters and gradients on
    CPU, so the weight sync's `full_tensor()` and the grad-norm all-reduce are collectives on CPU
    tensors. A group made with plain "nccl" has no CPU backend (torch 2.13,
    torch/distributed/distributed_c10d.py, `BackendConfig.__init__`: a single backend name maps
    only the devices in `Backend.backend_capability`, which for nccl is ["cuda"]), so those calls
    would fail with "No backend type associated with device type cpu"."""
    return "cuda:nccl,cpu:gloo" if device == "cuda" else "gloo"


def _release_cached_memory(device: torch.device) -> None:
    """Hand the CUDA caching allocator's free blocks back to the driver (for the rollout engine)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _init_process_group(
    device: str, rank: int, world_size: int, master_addr: str, master_port: int, timeout: datetime.timedelta
) -> None:
    """torch.distributed first (vLLM's external_launcher joins this world), from env vars.

    `timeout` (`trainer.dist_timeout_minutes`) bounds every collective, including the weight
    broadcast in which ranks > 0 wait while rank 0 reads the checkpoint (torch's NCCL default is
    10 minutes, less than reading a large model from network storage can take)."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank if device == "cpu" else 0), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
    )  # fmt: skip
    if device == "cuda":
        # Ray gives each rank one GPU via CUDA_VISIBLE_DEVICES, so the local device is always 0.
        torch.cuda.set_device(0)
        backend = process_group_backend(device)
    else:
        # Share the machine's cores between the ranks instead of oversubscribing them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        backend = process_group_backend(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
