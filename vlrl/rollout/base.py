"""The rollout engine interface and what every engine shares: sampling settings, token sets, checks.

An engine turns a `PromptBatch` into a `RolloutBatch` (n samples per prompt) and takes the actor's
weights after every update. Two implementations: `VLLMRolloutEngine` (SPMD, one per rank) and
`HFRolloutEngine` (transformers `generate`, for machines without vLLM and for debugging).
"""

from __future__ import annotations

import contextlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vlrl.batch.rows import FinishedGroups, PromptBatch, RolloutBatch
from vlrl.models.sampling import VISION_TOKENS, banned_token_ids  # noqa: F401 (engines' ban list)
from vlrl.rollout.sampling_keys import SAMPLING_KEYS
from vlrl.rollout.weight_sync import SyncStats, bucketize

DEFAULT_LIMIT_IMAGES = 4  # images per prompt when neither the config nor the trainer says


class NoWeightsError(RuntimeError):
    """`generate` was called before the engine received the actor's weights."""


@dataclass(frozen=True)
class SamplingSettings:
    """Sampling for one `generate` call: the config's values with the call's overrides applied."""

    n: int
    temperature: float
    top_p: float
    top_k: int  # -1: disabled
    seed: int | None  # None: continue the engine's random stream (seeded at start-up)
    ignore_eos: bool
    max_tokens: int
    logprobs: bool  # return the engine's log-probs of the sampled tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6


def resolve_sampling(
    config: Any, max_response_length: int, overrides: Mapping[str, Any] | None
) -> SamplingSettings:
    """`SamplingSettings` from a `RolloutConfig`, `data.max_response_length` and per-call overrides."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"unknown sampling override(s) {unknown}; valid keys: {list(SAMPLING_KEYS)}")
    value: dict[str, Any] = {key: overrides.get(key, getattr(config, key, None)) for key in SAMPLING_KEYS}
    value["max_tokens"] = overrides.get("max_tokens", max_response_length)
    # The config's seed seeds the engine once at start-up; a call reseeds only when asked to.
    value["seed"] = overrides.get("seed")
    top_k = int(value["top_k"])
    settings = SamplingSettings(
        n=int(value["n"]),
        temperature=float(value["temperature"]),
        top_p=float(value["top_p"]),
        top_k=-1 if top_k <= 0 else top_k,
        seed=None if value["seed"] is None else int(value["seed"]),
        ignore_eos=bool(value["ignore_eos"]),
        max_tokens=int(value["max_tokens"]),
        logprobs=bool(config.calculate_log_probs),
    )
    problems = []
    if settings.n < 1:
        problems.append(f"n={settings.n} must be >= 1")
    if settings.temperature < 0:
        problems.append(f"temperature={settings.temperature} must be >= 0")
    if not 0 < settings.top_p <= 1:
        problems.append(f"top_p={settings.top_p} must be in (0, 1]")
    if settings.max_tokens < 1:
        problems.append(f"max_tokens={settings.max_tokens} must be >= 1")
    if problems:
        raise ValueError("invalid sampling settings: " + "; ".join(problems))
    return settings


def eos_token_ids(tokenizer: Any, model_path: str | None = None) -> list[int]:
    """The model's EOS set: generation_config.json's `eos_token_id` (int or list) + the tokenizer's EOS."""
    ids: set[int] = set()
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    path = os.path.join(model_path, "generation_config.json") if model_path else ""
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None)
    if not ids:
        raise ValueError(f"no EOS token: neither the tokenizer nor {path or 'a generation config'} names one")
    return sorted(ids)


def pad_token_id(tokenizer: Any) -> int:
    """The pad id used for right-padding responses (the tokenizer's pad, else its EOS)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad if pad is not None else tokenizer.eos_token_id)


def resolve_limit_images(config: Any, limit_images: int | None) -> int:
    """Images per prompt the engine accepts: the config's value, else the trainer's, else a default."""
    if config.limit_images and config.limit_images > 0:
        return int(config.limit_images)
    if limit_images is not None and limit_images > 0:
        return int(limit_images)
    return DEFAULT_LIMIT_IMAGES


def check_prompts(prompts: PromptBatch, max_model_len: int, max_tokens: int, limit_images: int) -> None:
    """Raise a ValueError naming the row and the keys to change when a prompt cannot be served."""
    lengths = prompts.attention_mask.sum(-1).tolist()  # expanded prompt lengths (what the engine sees)
    budget = max_model_len - max_tokens
    for row, length in enumerate(lengths):
        if length > budget:
            raise ValueError(
                f"prompt {row} has {length} tokens (images expanded) but max_model_len={max_model_len} - "
                f"max_tokens={max_tokens} leaves {budget}; raise worker.rollout.max_model_len or lower "
                "data.max_prompt_length / data.max_response_length"
            )
    for row, images in enumerate(prompts.images):
        if len(images) > limit_images:
            raise ValueError(
                f"prompt {row} has {len(images)} images but the engine accepts {limit_images} per prompt; "
                "raise worker.rollout.limit_images"
            )


@contextlib.contextmanager
def seeded_rng(seed: int | None) -> Iterator[None]:
    """Run a block with torch's RNG seeded to `seed`, restoring the caller's RNG state afterwards.

    vLLM (in-process) and transformers sample from torch's default generators, so this makes one
    generate call a function of (seed, inputs) without touching the training process's RNG stream.
    """
    if seed is None:
        yield
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def sync_follows(config: Any, training: bool) -> bool:
    """Whether a hybrid rank's engine is synced before it generates again, after a generation
    (`training`: one that publishes rows for the step's update, else validation or ReMax's greedy pass).

    A step draws rounds until `data.rollout_batch_size` groups are kept (vlrl.trainer.rounds,
    `BatchFiller.fill`); after each round ReMax generates its greedy baselines; the update then
    syncs the weights (`RankWorker.update`). So the sync is next only after a training generation
    that is the step's one round: no online filtering, no smaller `data.mini_rollout_batch_size`,
    not ReMax. Validation is followed by a training generation. `config`: the `PPOConfig`."""
    data, algo = config.data, config.algorithm
    one_round = not algo.online_filtering and (
        data.mini_rollout_batch_size is None or data.mini_rollout_batch_size >= data.rollout_batch_size
    )
    return training and one_round and algo.adv_estimator != "remax"


class RolloutEngine(ABC):
    """What the trainer's per-rank worker calls. Subclasses set `dp_rank` and the token sets."""

    dp_rank: int = 0
    bucket_mb: float = 256
    eos_token_ids: list[int]
    pad_token_id: int
    banned_token_ids: list[int]

    @abstractmethod
    def generate(self, prompts: PromptBatch, overrides: Mapping[str, Any] | None = None) -> RolloutBatch:
        """n samples per prompt (group members adjacent); overrides: keys of `SAMPLING_KEYS`."""

    def generate_stream(
        self, prompts: PromptBatch, overrides: Mapping[str, Any] | None = None
    ) -> Iterator[FinishedGroups | RolloutBatch]:
        """`generate`, reporting groups as they finish (`FinishedGroups`), then the shard's
        `RolloutBatch` last. By default nothing finishes early: only the batch comes."""
        yield self.generate(prompts, overrides)

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_mb: float | None = None,
        stats: SyncStats | None = None,
    ) -> None:
        """Take full (unsharded) tensors with transformers-5 names, converted and loaded in buckets.

        `named_tensors` is consumed lazily (a generator of all-gathered shards works), so at most one
        bucket of `bucket_mb` MiB (default: `sync_bucket_mb`) is held at a time.
        """
        mapped = (
            (self.map_weight_name(name), self.map_weight_tensor(name, tensor))
            for name, tensor in named_tensors
        )
        self._load_buckets(bucketize(mapped, bucket_mb or self.bucket_mb, self.weight_dtype, stats))

    @abstractmethod
    def map_weight_name(self, name: str) -> str:
        """The name this engine's loader expects for an actor state_dict key."""

    def map_weight_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor in the layout this engine's loader expects (default: unchanged)."""
        return tensor

    @abstractmethod
    def _load_buckets(self, buckets: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
        """Load every bucket (lists of (mapped name, tensor in `weight_dtype`))."""

    @property
    @abstractmethod
    def weight_dtype(self) -> torch.dtype:
        """Dtype the engine keeps its weights in (sync converts to it before loading)."""

    policy_version: int | None = None
    """The trainer's version (updates done) of the weights loaded, when the caller labels them
    (asynchronous mode's rollout ranks): each sampled token then records it (`rollout_versions`)."""

    def set_policy_version(self, version: int) -> None:
        """Label the tokens sampled from now on with `version`."""
        self.policy_version = version

    between_steps: Callable[[], None] | None = None
    """Partial rollouts (asynchronous mode): called between two engine steps of a generation; it
    may load new weights there (`load_weights_in_flight`). None: never."""

    def load_weights_in_flight(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """New weights inside a generation (partial rollouts); only the vLLM engine steps itself."""
        raise NotImplementedError(f"{type(self).__name__} cannot take weights inside a generation")

    weights_discarded: bool = False
    """True after a `sleep` that discarded the weights (vLLM level 2): the engine refuses to
    generate until the next full weight sync."""

    def sleep(self, weights_replaced_next: bool = False) -> None:
        """Free memory between generations (GPU vLLM with sleep mode); a no-op otherwise.

        `weights_replaced_next`: the caller's next use of the engine is a full weight sync, so an
        engine may discard its weights instead of keeping a copy (`vllm_engine.sleep_level`)."""
        return None

    def wake_up(self) -> None:
        """Undo `sleep`; a no-op where `sleep` is."""
        return None

    def close(self) -> None:
        """Release the engine."""
        return None

    def call_seed(self, settings: SamplingSettings) -> int | None:
        """Seed of one call: the override plus the data-parallel rank (TP peers share it)."""
        return None if settings.seed is None else settings.seed + self.dp_rank
