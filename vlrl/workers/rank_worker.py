"""The per-rank Ray actor: one process holding an engine side (a rollout engine, vLLM SPMD or HF,
with its scoring and published rows) and a training side (an actor shard, FSDP2, and when KL is
on a reference policy), or one of them in asynchronous mode. The driver calls one method per phase
of a step.

Each method runs on every rank at once (the driver sends one shard per rank), because the
FSDP all-gathers and the weight sync are collectives: a rank that skipped a call would hang the others.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from vlrl.algorithms.kl import KLPenalty, PenalizedRewards
from vlrl.batch.held import TakePlan
from vlrl.batch.image_refs import ImageRefs
from vlrl.batch.rows import KeptRows, PromptBatch, RolloutBatch
from vlrl.batch.samples import StepSamples
from vlrl.config import PPOConfig
from vlrl.data.encoded_images import decoded
from vlrl.rewards.runner import RewardRunner
from vlrl.rollout.base import pad_token_id, sync_follows
from vlrl.rollout.weight_broadcast import WeightBroadcast
from vlrl.utils.background import in_background
from vlrl.utils.busy_clock import BUSY_S, WALL_S, BusyClock, busy
from vlrl.utils.gpu_driver import check_torch_sees_cuda
from vlrl.utils.library_logs import debugging, quiet_library_logs
from vlrl.utils.phase_times import PhaseTimes
from vlrl.utils.rank_threads import set_rank_threads
from vlrl.workers.engine_side import EngineSide, reports_rollouts
from vlrl.workers.scoring import BatchScorer
from vlrl.workers.training_side import TrainingSide
from vlrl.workers.weight_exchange import WeightIntake, WeightSender

if TYPE_CHECKING:
    from concurrent.futures import Future

    from vlrl.rollout.base import RolloutEngine
    from vlrl.workers.actor import Actor


class RankWorker:
    """Wrapped with `ray.remote` by the trainer (`vlrl.trainer.ray_workers.start_rank_groups`).

    Composed of an engine side (`vlrl.workers.engine_side`) and a training side
    (`vlrl.workers.training_side`): a hybrid rank holds both, a training rank of asynchronous mode
    only the second, a rollout rank only the first. Each method is one of the driver's calls; it
    runs on the side that serves it, and only what couples the two sides on a hybrid rank (room for
    the engine around a generation, the weights synced into it after an update) is here."""

    def __init__(
        self,
        config: PPOConfig,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        role: str = "hybrid",
        run_id: str | None = None,
    ) -> None:
        """`role`: hybrid (actor, reference and engine here), train (actor and reference only) or
        rollout (the engine only; asynchronous mode, `worker.rollout.async_ranks`). `rank` and
        `world_size` are those of this rank's own torch.distributed world: the training ranks', or
        a rollout rank's world of one. `run_id`: the driver's, names the engine's CPU shared memory
        (`vlrl.rollout.vllm_hooks.RUN_ID_ENV`)."""
        quiet_library_logs()
        if run_id:
            from vlrl.rollout.vllm_hooks import RUN_ID_ENV

            os.environ[RUN_ID_ENV] = run_id
        self.config = config
        self.rank, self.world_size, self.role = rank, world_size, role
        # Ray leaves a rank one thread (vlrl.utils.rank_threads); share the node's CPUs instead.
        self.cpu_threads = set_rank_threads(config.trainer.n_gpus_per_node, under_ray=_under_ray())
        _init_process_group(
            config.trainer.device, rank, world_size, master_addr, master_port,
            timeout=datetime.timedelta(minutes=config.trainer.dist_timeout_minutes),
        )  # fmt: skip
        self.device = torch.device(
            f"cuda:{torch.cuda.current_device()}" if config.trainer.device == "cuda" else "cpu"
        )
        # under Ray, batches carry image references (vlrl.batch.image_refs); in-process, the images
        # themselves. Either way dataset images come encoded and are decoded here, once per image.
        self.image_refs = ImageRefs.ray(local=decoded) if _under_ray() else None
        self.clock = BusyClock()  # wall time inside the driver's calls (vlrl.utils.busy_clock)
        # built by setup(), which the driver calls once the world is up
        self.engine_side: EngineSide | None = None
        self.training: TrainingSide | None = None

    # ------------------------------------------------------------------------- start-up
    def setup(
        self, limit_images: int, optimizer_steps: int, limit_videos: int = 0, score: bool = False
    ) -> dict[str, float]:
        """Load the models and the engine, then give the engine the actor's weights.

        `limit_images` / `limit_videos`: most images / videos in one prompt of the data;
        `optimizer_steps`: of the whole run (for the LR schedule); `score`: this rank will score
        what it generates (`generate(score=True)`), so its reward workers start now, beside the
        model loading (in a thread), and a reward file this node cannot load stops the run at
        start-up. Returns the first weight sync's metrics and the seconds of each phase
        (`setup/<phase>_s`, `vlrl.utils.phase_times`; rank 0 prints them with `VLRL_DEBUG` set)."""
        times = PhaseTimes()
        rewards = None
        if (
            score
            and self.role != "train"
            and reports_rollouts(self.config, self.rank, self.role == "rollout")
        ):
            # Its worker processes import the reward file while this rank loads the models: the
            # runner's start-up waits for them (`RewardRunner._start_all`), not this thread.
            rewards = in_background(lambda: RewardRunner(self.config.worker.reward), "vlrl-reward-start")
        try:
            metrics = self._load_models(times, limit_images, optimizer_steps, limit_videos)
        except BaseException:
            _close_when_started(rewards)
            raise
        if rewards is not None:
            with times.phase("reward_workers_wait"):
                self.engine_side_or_fail().rewards = rewards.result()
        if debugging() and self.rank == 0:
            times.print_to_stderr(f"{self.role} rank 0 setup:")
        return {**metrics, **times.metrics()}

    def _load_models(
        self, times: PhaseTimes, limit_images: int, optimizer_steps: int, limit_videos: int
    ) -> dict[str, float]:
        """`setup`'s loading, each phase timed in `times`; the first weight sync's metrics."""
        with times.phase("processor"):
            tokenizer, processor = self._load_processor()
        if self.role != "train":
            with times.phase("engine"):
                self.engine_side = self._build_engine_side(tokenizer, processor, limit_images, limit_videos)
        if self.role != "rollout":
            with times.phase("actor"):
                self.training = self._build_training_side(processor, optimizer_steps)
        if self.engine_side is None or self.training is None:
            return {}  # a rollout rank's weights come by broadcast before its first generation
        check_same_banned_tokens(
            self.engine_side.engine.banned_token_ids, self.training.actor.model.banned_token_ids
        )
        with times.phase("weight_sync"):
            return self.sync_weights()

    def _load_processor(self) -> tuple[Any, Any]:
        from vlrl.models.processor import load_processor

        model = self.config.worker.actor.model
        tokenizer, processor = load_processor(
            model.tokenizer_path or model.model_path, self.config.data.override_chat_template
        )
        self.pad_token_id = pad_token_id(tokenizer)  # the engines' (rows taken from them are padded with it)
        return tokenizer, processor

    def _build_engine_side(
        self, tokenizer: Any, processor: Any, limit_images: int, limit_videos: int
    ) -> EngineSide:
        from vlrl.rollout import create_rollout_engine
        from vlrl.rollout.base import eos_token_ids

        model_path, rollout_only = self.config.worker.actor.model.model_path, self.role == "rollout"
        scorer = BatchScorer(
            tokenizer, self.pad_token_id, eos_token_ids(tokenizer, model_path),
            self.config.worker.reward.skip_special_tokens,
        )  # fmt: skip
        engine = create_rollout_engine(
            self.config.worker.rollout, self.config.data, model_path, tokenizer, processor,
            limit_images=limit_images, limit_videos=limit_videos, rollout_only=rollout_only,
        )  # fmt: skip
        return EngineSide(
            self.config, self.rank, engine, scorer, self.image_refs, self._fetch_media, rollout_only
        )

    def _build_training_side(self, processor: Any, optimizer_steps: int) -> TrainingSide:
        """The actor and, with KL on, the reference."""
        from vlrl.workers.from_config import build_actor, build_reference

        actor = build_actor(self.config, processor, self.device, total_steps=optimizer_steps)
        reference = (
            build_reference(self.config, processor, self.device, actor=actor)
            if self.config.plan.reference
            else None
        )
        return TrainingSide(
            self.config,
            self.rank,
            actor,
            reference,
            self.pad_token_id,
            self._fetch_media,
            self.release_images,
        )

    def banned_token_ids(self) -> tuple[int, ...]:
        """The tokens this rank's policy never samples: the actor's, or a rollout rank's engine's
        (the driver compares them across roles in asynchronous mode)."""
        if self.training is not None:
            return self.training.actor.model.banned_token_ids
        return tuple(self.engine_side_or_fail().engine.banned_token_ids)

    def engine_side_or_fail(self) -> EngineSide:
        if self.engine_side is None:
            raise RuntimeError(
                f"rank {self.rank} ({self.role}) holds no engine: setup first, or a generating rank"
            )
        return self.engine_side

    def training_or_fail(self) -> TrainingSide:
        if self.training is None:
            raise RuntimeError(
                f"rank {self.rank} ({self.role}) holds no actor: setup first, or a training rank"
            )
        return self.training

    @property
    def actor(self) -> Actor:
        """The actor shard (tools and tests read it)."""
        return self.training_or_fail().actor

    # ------------------------------------------------------------------------- step phases
    @busy
    def generate(
        self,
        prompts: PromptBatch,
        overrides: dict[str, Any] | None = None,
        keep_for: int | None = None,
        score: bool = False,
        responses_back: bool = True,
    ) -> StepSamples | None:
        """Sample responses for this rank's prompts (its data-parallel shard); None on a
        tensor-parallel peer that is not its group's first rank (the first reports the same rows).

        The rows stay here: with `keep_for` (the step that trains on them) the batch is published
        (`vlrl.batch.held`) and the driver gets `StepSamples` that say where it is; the training ranks
        take their rows from it. This rank holds its published batches until it generates for a later
        step (`Holdings`), so they outlive every reference the driver and the other ranks pass along.
        Without `keep_for` (validation, ReMax's greedy pass) nothing is published.

        With `score` this rank scores its rows in its own reward workers (`vlrl.workers.scoring`;
        each group as the engine reports it, with `worker.reward.streaming`) and the samples carry
        their reward parts; `responses_back`: they carry the response ids too."""
        room = self._room_for_engine if self.training is not None else _no_room
        samples = self.engine_side_or_fail().generate(
            prompts, overrides, keep_for, score, responses_back, room
        )
        if samples is not None:
            samples.busy_clock = self.clock.reading()
        return samples

    @contextlib.contextmanager
    def _room_for_engine(self, training: bool) -> Iterator[None]:
        """A hybrid rank's generation: the actor's shards leave the GPU first
        (`worker.actor.offload`) and the allocator's cached blocks are released, so the engine can
        wake into that memory; the engine sleeps again and they come back afterwards. It discards
        its weights in that sleep when the update's sync comes next (`training`: rows for the
        update; `vlrl.rollout.base.sync_follows`)."""
        engine, actor = self.engine_side_or_fail().engine, self.training_or_fail().actor
        if engine.weights_discarded:
            # A level-2 sleep that no sync followed (not expected, `sync_follows`): the actor holds
            # exactly the weights the engine discarded, so this costs a sync, not correctness.
            self.sync_weights()
        actor.offload_to_cpu()
        _release_cached_memory(self.device)
        try:
            engine.wake_up()
            yield
            engine.sleep(weights_replaced_next=sync_follows(self.config, training))
        finally:
            actor.load_to_device()

    def release_images(self) -> None:
        """Drop this rank's hold on the step's images (the driver calls it after validation; an
        update does it itself)."""
        if self.image_refs is not None:
            self.image_refs.clear()

    def _fetch_media(self, batch: PromptBatch | RolloutBatch) -> None:
        """Images and videos that came as references, fetched (once per step) in place; encoded
        images decoded (by `ImageRefs`, once per reference; in-process, once per object)."""
        if self.image_refs is not None:
            self.image_refs.fetch(batch)
        else:
            batch.images = [[decoded(image) for image in row] for row in batch.images]

    @busy
    def take_rows(
        self, plan: TakePlan, rows: list[int], kl_penalty: KLPenalty | None = None
    ) -> PenalizedRewards | None:
        """Take this rank's rows of the step (`plan`: from the generating ranks' published batches;
        `rows`: their step row ids) and keep them for the update, with the log-probs the step plan
        asks for (vlrl.algorithms.plan): the old policy's (all rows, those after this rank's first
        mini-batch, or none: the update computes the rest) and, when KL is on, the reference's.

        With `kl_penalty` (the KL penalty in the reward) returns the rows' rewards with it, per
        sequence (per token too when asked); else None: everything stays here."""
        return self.training_or_fail().take_rows(plan, rows, kl_penalty)

    @busy
    def update(self, kept: KeptRows) -> tuple[dict[str, float], dict[str, float]]:
        """One PPO update on the rows `take_rows` kept here, then (a hybrid rank) push the new
        weights to the engine.

        With an off-policy correction (`algorithm.off_policy_correction`, `tis_cap`) the advantages
        are weighted here, where the engine's and the actor's log-probs are; with
        `algorithm.old_policy=rollout` the engine's log-probs are the old ones. Returns the
        update's metrics and the engine-vs-actor drift of the sampled tokens' log-probs
        (`log_prob_drift`: its mean, max and token count; {} without engine log-probs)."""
        metrics, drift = self.training_or_fail().update(kept)
        if self.engine_side is not None:
            metrics.update(self.sync_weights())
        metrics[BUSY_S], metrics[WALL_S] = self.clock.reading()  # the driver turns them into idle shares
        return metrics, drift

    def sync_weights(self) -> dict[str, float]:
        """A hybrid rank: the actor's weights into its own engine."""
        from vlrl.rollout import sync_weights

        actor, engine = self.training_or_fail().actor, self.engine_side_or_fail().engine
        return sync_weights(actor.model.module, engine, self.config.worker.rollout.sync_bucket_mb)

    # ------------------------------------------------------------------ asynchronous mode
    def free_address(self) -> tuple[str, int]:
        """This node's address and a free port on it (training rank 0 hosts the broadcast group)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def join_weight_broadcast(self, host: str, port: int, member: int | None, members: int) -> None:
        """Training rank 0 (member 0) and every rollout rank (1..) join the broadcast group; all of
        them must be in this call at once (the group's rendezvous). The other training ranks
        (`member` None) are not members but send too (they take part in the all-gathers)."""
        from vlrl.rollout.vllm_engine import VLLM_DTYPES

        rollout = self.config.worker.rollout
        broadcast = None
        if member is not None:
            broadcast = WeightBroadcast(
                host,
                port,
                member,
                members,
                self.config.trainer.device,
                self.config.trainer.dist_timeout_minutes,
            )
        if self.training is not None:
            dtype = getattr(torch, VLLM_DTYPES[rollout.dtype])
            self.training.sender = WeightSender(broadcast, rollout.sync_bucket_mb, dtype, self.clock)
            return
        side = self.engine_side_or_fail()
        assert broadcast is not None, "a rollout rank is a member of the broadcast group"
        side.intake = WeightIntake(broadcast, side.engine, rollout.partial_rollouts, clock=self.clock)

    @busy
    def send_weights(self, version: int, background: bool = False) -> dict[str, float]:
        """Every training rank walks the actor's full tensors (FSDP all-gathers); rank 0 broadcasts
        them in the engines' dtype as the weights of `version` (updates done), while every rollout
        rank is in `receive_weights` or, with partial rollouts, takes them between two engine steps.
        `background` (a staleness bound above 1): sent from a thread (`WeightSender.send`)."""
        return self.training_or_fail().send_weights(version, background)

    def finish_send(self) -> dict[str, float]:
        """Wait for a background send (`send_weights(background=True)`); its metrics, or {}."""
        sender = self.training_or_fail().sender
        return sender.finish() if sender is not None else {}

    @busy
    def receive_weights(self, version: int) -> None:
        """Load the weights of `version` training rank 0 broadcasts into this rollout rank's engine
        (nothing left to take when a generation took them between its steps)."""
        intake = self.engine_side_or_fail().intake
        assert intake is not None, "join_weight_broadcast first"
        intake.receive(version)

    # ------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str, model_only: bool) -> None:
        """Sharded actor state + the config/processor (for `vlrl.tools.model_merger`) written by rank 0;
        with `model_only`, just a Hugging Face folder of the weights (not resumable)."""
        self.training_or_fail().save_checkpoint(path, model_only)

    def load_checkpoint(self, path: str) -> dict[str, float]:
        self.training_or_fail().actor.load_checkpoint(path)
        return self.sync_weights() if self.engine_side is not None else {}

    def process(self) -> tuple[int, str, str]:
        """(pid, host, CPU threads) of this rank's process, for messages about it and the start-up log."""
        return os.getpid(), socket.gethostname(), self.cpu_threads

    def digest_checkpoint_files(self, folder: str) -> dict[str, dict[str, Any]]:
        """This rank's share of a checkpoint's checksums (file i of the sorted list when i % world == rank)."""
        from vlrl.utils.checkpoint_files import digest_files

        return digest_files(folder, self.rank, self.world_size)

    def verify_checkpoint_files(self, folder: str, files: dict[str, dict[str, Any]]) -> list[str]:
        """This rank's share of checking a checkpoint's files against their checksums."""
        from vlrl.utils.checkpoint_files import verify_files

        return verify_files(folder, files, self.rank, self.world_size)

    def probe_shared_path(self, marker: str, token: str) -> tuple[bool, str]:
        """Whether this rank sees the driver's checkpoint folder (`check_shared_filesystem`)."""
        from vlrl.utils.checkpoint_files import probe_shared_path

        return probe_shared_path(marker, token, self.rank)

    def shutdown(self, process_ends: bool = False) -> None:
        """Stop the reward workers and the engine. `process_ends`: the caller ends this process
        next (the Ray driver kills its rank workers, `RankGroup.shutdown`), so the engine's memory
        is left to the OS (`VLLMRolloutEngine.close`); in-process ranks free it."""
        side = getattr(self, "engine_side", None)  # set up (an in-process group may stop before setup)
        if side is not None:
            if side.rewards is not None:
                side.rewards.close()
            _close_engine(side.engine, process_ends)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@contextlib.contextmanager
def _no_room(training: bool) -> Iterator[None]:
    """A rollout rank's generation: its engine holds the device alone, awake between steps."""
    yield


def check_same_banned_tokens(engine: tuple[int, ...] | list[int], actor: tuple[int, ...]) -> None:
    """The engine must sample the distribution the actor scores (vlrl.models.sampling)."""
    if tuple(engine) != tuple(actor):
        raise RuntimeError(
            f"the rollout engine bans tokens {tuple(engine)} but the actor scores a distribution without "
            f"{tuple(actor)}: they must sample and score the same policy (vlrl.models.sampling); check "
            "worker.actor.model.tokenizer_path"
        )


def _close_engine(engine: RolloutEngine, process_ends: bool) -> None:
    from vlrl.rollout.vllm_engine import VLLMRolloutEngine

    if isinstance(engine, VLLMRolloutEngine):
        engine.close(process_ends=process_ends)
    else:
        engine.close()


def _close_when_started(rewards: Future[RewardRunner] | None) -> None:
    """Stop the reward workers `setup` started in the background (a failed setup): wait for their
    start-up to end, then close them; their own start-up error is dropped for setup's."""
    if rewards is None:
        return
    with contextlib.suppress(BaseException):
        rewards.result().close()


def _under_ray() -> bool:
    """In a Ray actor. False where Ray is not installed (the GPU acceptance check's machines)."""
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


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
    device: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout: datetime.timedelta,
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
        check_torch_sees_cuda()  # a clear message instead of torch's "no CUDA GPUs are available"
        # Ray gives each rank one GPU via CUDA_VISIBLE_DEVICES, so the local device is always 0.
        torch.cuda.set_device(0)
    backend = process_group_backend(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
