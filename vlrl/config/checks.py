"""Cross-field rules of a `PPOConfig`. Each returns messages that say which keys to change.

Everything a long run could trip over later (batch arithmetic, engine limits, a missing reward
file or model folder) is checked here, at start-up.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from typing import TYPE_CHECKING

from vlrl.algorithms.plan import CORRECTION_NEEDS, ESTIMATOR_NEEDS

if TYPE_CHECKING:
    from vlrl.config import ActorConfig, AlgorithmConfig, DataConfig, PPOConfig

MAX_STALENESS = 16  # steps the generation may run ahead of training (worker.rollout.max_staleness)
KNOWN_LOGGERS = ("console", "file", "wandb", "tensorboard", "swanlab", "mlflow")
# logger -> the package it needs (checked at start-up, not at the first log call)
LOGGER_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "swanlab": "swanlab", "mlflow": "mlflow"}


def check_config(config: PPOConfig) -> list[str]:
    errors: list[str] = []
    for check in (
        _check_sequence_parallel,
        _check_batch_sizes,
        _check_not_supported_yet,
        _check_algorithm,
        _check_rollout,
        _check_async,
        _check_lora,
        _check_reward,
        _check_multi_turn,
        _check_trainer,
        _check_numbers,
        _check_gradient_checkpointing,
        _check_paths,
    ):
        errors.extend(check(config))
    return errors


def check_data_media(config: PPOConfig, max_videos_per_prompt: int) -> list[str]:
    """Rules that need the data: features that do not take videos yet, against the most videos one
    prompt of the training or validation data holds. `TrainingData` calls this once the datasets
    are built, before Ray and the ranks start; without it such a run would fail at its first
    generation or first forward pass (the engine's and packing's own checks are backstops for
    direct library use)."""
    if max_videos_per_prompt < 1:
        return []
    rollout, size = config.worker.rollout, config.worker.actor.ulysses_size
    key = f"data.video_key={config.data.video_key!r}"
    has = f"the data has videos (up to {max_videos_per_prompt} per prompt, column {key})"
    errors = []
    if size > 1:
        errors.append(
            f"{has}, but worker.actor.ulysses_size={size}: sequence parallelism does not take videos yet; "
            "set worker.actor.ulysses_size=1 or drop the videos"
        )
    if rollout.multi_turn.enable:
        errors.append(
            f"{has}, but worker.rollout.multi_turn.enable=true: multi-turn rollouts do not take videos yet; "
            "turn multi_turn off or drop the videos"
        )
    if rollout.name != "vllm":
        errors.append(
            f"{has}, which only the vLLM engine takes: set worker.rollout.name=vllm (not {rollout.name!r})"
        )
    return errors


def _check_lora(config: PPOConfig) -> list[str]:
    lora = config.worker.actor.model.lora
    key = "worker.actor.model.lora"
    if lora.rank < 0:
        return [f"{key}.rank={lora.rank} must be >= 0 (0 trains all weights)"]
    if lora.rank == 0:
        return []
    errors = []
    if lora.alpha <= 0:
        errors.append(f"{key}.alpha={lora.alpha} must be > 0 (the adapters are scaled by alpha / rank)")
    if not str(lora.target_modules or "").replace(",", "").strip():
        errors.append(
            f"{key}.target_modules is empty: give 'all-linear' or a comma list such as q_proj,v_proj"
        )
    if lora.exclude_modules:
        try:
            re.compile(lora.exclude_modules)
        except re.error as err:
            errors.append(f"{key}.exclude_modules={lora.exclude_modules!r} is not a valid regex: {err}")
    if importlib.util.find_spec("peft") is None:
        errors.append(f"{key}.rank > 0 needs the `peft` package: pip install 'peft==0.21.*'")
    return errors


def _check_token_budget(actor: ActorConfig) -> list[str]:
    """`max_token_len_per_device` is positive, and only set where dynamic batching uses it."""
    budget = actor.max_token_len_per_device
    if budget is None:
        return []
    if budget < 1:
        return [
            f"worker.actor.max_token_len_per_device={budget} must be >= 1 (or null: micro-batch size x width)"
        ]
    if not actor.dynamic_batching:
        return [
            f"worker.actor.max_token_len_per_device={budget} is a dynamic-batching budget, but "
            "worker.actor.dynamic_batching=false forms micro-batches by sample count: set dynamic_batching=true "
            "or drop the budget"
        ]
    return []


def _check_batch_sizes(config: PPOConfig) -> list[str]:
    data, actor, n, world = config.data, config.worker.actor, config.worker.rollout.n, config.train_world_size
    errors = []
    positive = {
        "data.rollout_batch_size": data.rollout_batch_size,
        "worker.actor.global_batch_size": actor.global_batch_size,
        "worker.actor.micro_batch_size_per_device_for_update": actor.micro_batch_size_per_device_for_update,
        "worker.actor.micro_batch_size_per_device_for_experience": actor.micro_batch_size_per_device_for_experience,
        "worker.rollout.n": n,
        "trainer.nnodes": config.trainer.nnodes,
        "trainer.n_gpus_per_node": config.trainer.n_gpus_per_node,
        "data.max_prompt_length": data.max_prompt_length,
        "data.max_response_length": data.max_response_length,
    }
    for key, value in positive.items():
        if value < 1:
            errors.append(f"{key}={value} must be >= 1")
    if not data.video_fps > 0:
        errors.append(f"data.video_fps={data.video_fps} must be > 0 (frames per second sampled from videos)")
    errors += _check_token_budget(actor)
    if errors:
        return errors
    if data.rollout_batch_size % actor.global_batch_size:
        errors.append(
            f"data.rollout_batch_size={data.rollout_batch_size} must be divisible by "
            f"worker.actor.global_batch_size={actor.global_batch_size}"
        )
    if _check_sequence_parallel(config):
        return errors  # the data-parallel group count is undefined; reported there
    dp, sp = config.dp_size, actor.ulysses_size
    if (actor.global_batch_size * n) % dp:
        groups = f"the world size {world} (trainer.nnodes x trainer.n_gpus_per_node)"
        if sp > 1:
            groups = f"the {dp} data-parallel groups (world size {world} / worker.actor.ulysses_size={sp})"
        errors.append(
            f"worker.actor.global_batch_size={actor.global_batch_size} x worker.rollout.n={n} must be divisible "
            f"by {groups}"
        )
    elif (
        not actor.dynamic_batching
        and config.samples_per_minibatch_per_rank % actor.micro_batch_size_per_device_for_update
    ):
        errors.append(
            f"each rank gets {config.samples_per_minibatch_per_rank} samples per optimizer step "
            f"(global_batch_size x n / data-parallel groups), which must be divisible by "
            f"worker.actor.micro_batch_size_per_device_for_update={actor.micro_batch_size_per_device_for_update}"
        )
    mini, tries = data.mini_rollout_batch_size, config.trainer.max_try_make_batch
    if mini is not None and mini < 1:
        errors.append(f"data.mini_rollout_batch_size={mini} must be >= 1 (or null)")
    elif mini is not None and tries > 0 and -(-data.rollout_batch_size // mini) > tries:
        errors.append(
            f"data.rollout_batch_size={data.rollout_batch_size} takes {-(-data.rollout_batch_size // mini)} rounds "
            f"of data.mini_rollout_batch_size={mini} prompts, more than trainer.max_try_make_batch={tries}"
        )
    return errors


def _check_sequence_parallel(config: PPOConfig) -> list[str]:
    """worker.actor.ulysses_size: divides the world, packed rows only (the model's heads are checked
    when it is loaded, vlrl.models.ulysses.head_errors)."""
    actor, world, size = config.worker.actor, config.train_world_size, config.worker.actor.ulysses_size
    if size < 1:
        return [f"worker.actor.ulysses_size={size} must be >= 1"]
    errors = []
    if world % size:
        errors.append(
            f"worker.actor.ulysses_size={size} must divide the world size {world} "
            "(trainer.nnodes x trainer.n_gpus_per_node)"
        )
    if size > 1 and not (actor.padding_free and config.worker.ref.padding_free):
        errors.append(
            f"worker.actor.ulysses_size={size} splits packed rows: set worker.actor.padding_free=true and "
            "worker.ref.padding_free=true"
        )
    return errors


def _check_not_supported_yet(config: PPOConfig) -> list[str]:
    """EasyR1 keys that load but whose other values name features vlrl does not have."""
    worker, world = config.worker, config.train_world_size
    errors = []
    if not worker.hybrid_engine:
        errors.append(
            "worker.hybrid_engine=false: the actor and reference always share their ranks; for ranks that "
            "only generate set worker.rollout.async_ranks (asynchronous mode, docs/async.md) and keep this true"
        )
    for key, strategy in (
        ("worker.actor.strategy", worker.actor.strategy),
        ("worker.ref.strategy", worker.ref.strategy),
    ):
        if strategy != "fsdp":
            errors.append(f"{key}={strategy!r}: only fsdp (FSDP2) is supported")
    for section, fsdp in (("worker.actor.fsdp", worker.actor.fsdp), ("worker.ref.fsdp", worker.ref.fsdp)):
        if fsdp.fsdp_size == 0 or fsdp.fsdp_size < -1:
            errors.append(f"{section}.fsdp_size={fsdp.fsdp_size} must be -1 or >= 1")
        elif fsdp.fsdp_size > 0 and world % fsdp.fsdp_size:
            errors.append(
                f"{section}.fsdp_size={fsdp.fsdp_size} must divide the {world} training ranks: the ranks "
                "form groups of fsdp_size that each hold one sharded copy (hybrid sharding); -1 shards over all"
            )
        if fsdp.mp_buffer_dtype not in ("fp32", "float32"):
            errors.append(f"{section}.mp_buffer_dtype={fsdp.mp_buffer_dtype!r}: only fp32 is supported")
        for name in ("torch_dtype", "mp_param_dtype", "mp_reduce_dtype"):
            value = getattr(fsdp, name)
            if value is not None and value not in DTYPE_NAMES:
                errors.append(f"{section}.{name}={value!r} is unknown; choose one of {list(DTYPE_NAMES)}")
    if config.data.filter_overlong_prompts_workers < 1:
        errors.append(
            f"data.filter_overlong_prompts_workers={config.data.filter_overlong_prompts_workers} must be >= 1"
        )
    return errors


DTYPE_NAMES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")


def _check_algorithm(config: PPOConfig) -> list[str]:
    from vlrl.algorithms import ADV_ESTIMATORS, GROUP_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES

    algo, actor = config.algorithm, config.worker.actor
    errors = []
    for key, value, valid in (
        ("algorithm.adv_estimator", algo.adv_estimator, ADV_ESTIMATORS),
        ("algorithm.kl_penalty", algo.kl_penalty, KL_ESTIMATORS),
        ("worker.actor.policy_loss", actor.policy_loss, POLICY_LOSSES),
        ("worker.actor.loss_avg_mode", actor.loss_avg_mode, LOSS_AGG_MODES),
        ("algorithm.kl_type", algo.kl_type, ("fixed", "adaptive")),
        ("worker.actor.optim.strategy", actor.optim.strategy, ("adamw", "adamw_bf16")),
        ("worker.actor.optim.lr_scheduler_type", actor.optim.lr_scheduler_type, ("constant", "cosine")),
    ):
        if value not in valid:
            errors.append(f"{key}={value!r} is unknown; choose one of {sorted(valid)}")
    if algo.adv_estimator in GROUP_ESTIMATORS and config.worker.rollout.n < 2:
        errors.append(
            f"algorithm.adv_estimator={algo.adv_estimator} compares samples of one prompt: set worker.rollout.n >= 2"
        )
    if actor.clip_ratio_dual is not None and actor.clip_ratio_dual <= 1.0:
        errors.append(f"worker.actor.clip_ratio_dual={actor.clip_ratio_dual} must be > 1")
    if not 0 <= actor.clip_ratio_low < 1:
        errors.append(
            f"worker.actor.clip_ratio_low={actor.clip_ratio_low} must be in [0, 1): the ratio's lower bound "
            "is 1 - clip_ratio_low, and at or below 0 nothing is clipped"
        )
    if not actor.clip_ratio_high >= 0:
        errors.append(f"worker.actor.clip_ratio_high={actor.clip_ratio_high} must be >= 0")
    if algo.online_filtering and algo.adv_estimator == "remax":
        errors.append("algorithm.adv_estimator=remax cannot be combined with algorithm.online_filtering=true")
    if algo.online_filtering and not algo.filter_low < algo.filter_high:
        errors.append(
            f"algorithm.filter_low={algo.filter_low} must be < algorithm.filter_high={algo.filter_high}"
        )
    return errors


def _check_async(config: PPOConfig) -> list[str]:
    """worker.rollout.async_ranks / max_staleness, algorithm.tis_cap and algorithm.old_policy."""
    rollout, algo = config.worker.rollout, config.algorithm
    errors = []
    errors += _correction_errors(algo)
    if algo.old_policy not in ("auto", "actor", "rollout"):
        errors.append(f"algorithm.old_policy={algo.old_policy!r} is unknown; choose auto, actor or rollout")
    elif algo.old_policy == "rollout" and algo.off_policy_correction is not None:
        errors.append(
            "algorithm.old_policy=rollout measures the ratio from the engine's log-probs: it takes no "
            "algorithm.off_policy_correction / tis_cap (the ratio already corrects for the sampling policy)"
        )
    elif algo.adv_estimator in ESTIMATOR_NEEDS:
        errors += config.plan.problems()  # what the step plan needs from the engines
    errors += _truncated_ratio_errors(config)
    errors += _partial_rollout_errors(config)
    if rollout.async_ranks == 0:
        return errors
    if not 0 < rollout.async_ranks < config.world_size:
        errors.append(
            f"worker.rollout.async_ranks={rollout.async_ranks} must leave at least one of the "
            f"{config.world_size} ranks (trainer.nnodes x trainer.n_gpus_per_node) to train"
        )
    if not 0 <= rollout.max_staleness <= MAX_STALENESS:
        errors.append(
            f"worker.rollout.max_staleness={rollout.max_staleness}: 0 to {MAX_STALENESS} (each step ahead "
            "keeps one more generated batch on the rollout ranks)"
        )
    if rollout.tensor_parallel_size != 1:
        errors.append("asynchronous mode (worker.rollout.async_ranks) runs one engine per rollout rank: "
                      "set worker.rollout.tensor_parallel_size=1")  # fmt: skip
    if rollout.name != "vllm":
        errors.append(
            "asynchronous mode loads broadcast weights into vLLM engines: set worker.rollout.name=vllm"
        )
    if rollout.multi_turn.enable:
        errors.append("asynchronous mode with multi-turn rollouts is not built: turn one of them off")
    if config.worker.actor.model.lora.rank > 0:
        errors.append(
            "asynchronous mode with LoRA is not built (merged weights are broadcast by the hybrid sync only)"
        )
    return errors


def _partial_rollout_errors(config: PPOConfig) -> list[str]:
    """worker.rollout.partial_rollouts: weights taken inside a generation need one in flight when a
    sync comes (a staleness bound of 2 or more) and a ratio measured from the sampling policy."""
    rollout = config.worker.rollout
    if not rollout.partial_rollouts:
        return []
    if rollout.async_ranks == 0 or rollout.max_staleness < 2:
        return [
            "worker.rollout.partial_rollouts needs asynchronous mode with generations in flight when the "
            "weights change: set worker.rollout.async_ranks >= 1 and worker.rollout.max_staleness >= 2 "
            f"(now {rollout.async_ranks} and {rollout.max_staleness})"
        ]
    plan = config.plan
    if plan.ratio_from == "actor" and plan.correction == "none":
        return [
            "worker.rollout.partial_rollouts with algorithm.old_policy=actor and no off-policy correction "
            "would measure the ratio from a policy that sampled none of the tokens: use old_policy=auto "
            "(the engine's log-probs, per token) or set algorithm.off_policy_correction"
        ]
    return []


def _correction_errors(algo: AlgorithmConfig) -> list[str]:
    """algorithm.off_policy_correction, correction_bound and the tis_cap shorthand (resolved by derive)."""
    kind, bound = algo.off_policy_correction, algo.correction_bound
    if kind is None:
        return []
    if kind not in CORRECTION_NEEDS:
        return [
            f"algorithm.off_policy_correction={kind!r} is unknown; choose one of {', '.join(CORRECTION_NEEDS)}"
        ]
    errors = []
    if algo.tis_cap is not None and (kind != "token_tis" or bound != algo.tis_cap):
        errors.append(
            f"algorithm.tis_cap={algo.tis_cap} is the shorthand for off_policy_correction=token_tis with "
            f"correction_bound={algo.tis_cap}; with off_policy_correction={kind} set correction_bound "
            "instead and drop tis_cap"
        )
    low = 1.0 if kind.endswith("mask") else 0.0  # a mask's band [1/C, C] is empty below 1
    if not bound > low:
        errors.append(
            f"algorithm.correction_bound={bound} must be > {low:g} for off_policy_correction={kind}"
        )
    return errors


def _truncated_ratio_errors(config: PPOConfig) -> list[str]:
    """algorithm.old_policy=rollout with top-k, or a top-p below the PPO clip's lower bound.

    The engine's log-probs are those of the truncated, renormalised distribution it samples from, on
    the CPU and the GPU runner alike (vlrl/rollout/vllm_settings.py, LOGPROBS_MODE); the actor scores
    the untruncated one (vlrl/models/sampling.py). With old_policy=rollout the PPO ratio is
    pi_actor / pi_engine, which before any update equals the mass Z the truncation keeps, not 1.
    top-p keeps Z >= top_p; top-k bounds nothing. Once Z < 1 - clip_ratio_low the clip holds a
    token's ratio before the update has moved it (no gradient for its negative advantages).
    an off-policy correction (tis_cap) is not refused: pi_old / pi_engine is the importance weight toward the
    distribution that actually sampled."""
    rollout, algo, actor = config.worker.rollout, config.algorithm, config.worker.actor
    if algo.old_policy != "rollout" or not (rollout.top_k > 0 or rollout.top_p < 1 - actor.clip_ratio_low):
        return []
    return [
        f"algorithm.old_policy=rollout (auto picks it in asynchronous mode) with worker.rollout.top_p="
        f"{rollout.top_p} / top_k={rollout.top_k}: the engine's log-probs are of the truncated distribution "
        "and the actor's of the untruncated one, so the PPO ratio starts at the kept probability mass "
        f"instead of 1; below 1 - worker.actor.clip_ratio_low={1 - actor.clip_ratio_low:g} the clip "
        "then drops the gradient of those tokens' negative advantages before the update moved anything. "
        "Set top_k=-1 and top_p >= "
        f"{1 - actor.clip_ratio_low:g} (1: no truncation), or algorithm.old_policy=actor (with "
        "algorithm.off_policy_correction to correct for the sampling policy)"
    ]


def _check_rollout(config: PPOConfig) -> list[str]:
    rollout, data, world = config.worker.rollout, config.data, config.rollout_world_size
    errors = []
    if rollout.name not in ("vllm", "hf"):
        errors.append(f"worker.rollout.name={rollout.name!r} is unknown; choose vllm or hf")
    if rollout.tensor_parallel_size < 1 or world % rollout.tensor_parallel_size:
        errors.append(
            f"worker.rollout.tensor_parallel_size={rollout.tensor_parallel_size} must divide the world size {world}"
        )
    elif config.trainer.n_gpus_per_node % rollout.tensor_parallel_size:
        errors.append(
            f"worker.rollout.tensor_parallel_size={rollout.tensor_parallel_size} must divide "
            f"trainer.n_gpus_per_node={config.trainer.n_gpus_per_node}: a tensor-parallel group must "
            "sit on one node"
        )
    needed = data.max_prompt_length + data.max_response_length
    if rollout.max_model_len is not None and rollout.max_model_len < needed:
        errors.append(
            f"worker.rollout.max_model_len={rollout.max_model_len} < data.max_prompt_length + "
            f"data.max_response_length = {needed}; raise it or shorten the lengths"
        )
    if not rollout.enable_chunked_prefill and rollout.max_num_batched_tokens < needed:
        errors.append(
            f"worker.rollout.max_num_batched_tokens={rollout.max_num_batched_tokens} < prompt + response length "
            f"{needed}; raise it or set worker.rollout.enable_chunked_prefill=true"
        )
    if not 0 < rollout.gpu_memory_utilization <= 1:
        errors.append(
            f"worker.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} must be in (0, 1]"
        )
    if rollout.temperature <= 0:
        errors.append(
            f"worker.rollout.temperature={rollout.temperature} must be > 0: training needs sampled responses "
            "and their log-probs (greedy decoding belongs in worker.rollout.val_override_config)"
        )
    from vlrl.rollout.sampling_keys import SAMPLING_KEYS  # the engines' rule (a light module)

    bad = sorted(set(rollout.val_override_config) - set(SAMPLING_KEYS))
    if bad:
        errors.append(
            f"worker.rollout.val_override_config has unknown keys {bad}; valid: {list(SAMPLING_KEYS)}"
        )
    return errors


def _check_reward(config: PPOConfig) -> list[str]:
    reward = config.worker.reward
    errors = []
    if reward.reward_type not in (None, "batch", "sequential"):
        errors.append(f"worker.reward.reward_type={reward.reward_type!r} must be batch or sequential")
    if reward.on_failure not in ("raise", "zero"):
        errors.append(f"worker.reward.on_failure={reward.on_failure!r} must be raise or zero")
    if not reward.reward_function:
        errors.append(
            "worker.reward.reward_function is required (e.g. ./reward_functions/boxed_math.py:compute_score)"
        )
    else:
        path = (
            reward.reward_function.rsplit(":", 1)[0]
            if ":" in reward.reward_function
            else reward.reward_function
        )
        if not os.path.isfile(path):
            errors.append(f"worker.reward.reward_function: file {path!r} does not exist")
    if reward.num_workers < 0:
        errors.append(f"worker.reward.num_workers={reward.num_workers} must be >= 0")
    if reward.timeout <= 0:
        errors.append(f"worker.reward.timeout={reward.timeout} must be > 0")
    if reward.memory_limit_mb is not None:
        if reward.memory_limit_mb < 64:
            errors.append(f"worker.reward.memory_limit_mb={reward.memory_limit_mb} must be >= 64 (or null)")
        if reward.num_workers == 0:
            errors.append(
                "worker.reward.memory_limit_mb caps worker processes: set worker.reward.num_workers >= 1"
            )
    return errors


def _spec_file(spec: str) -> str:
    """The file part of `path/to/file.py:function`."""
    return spec.rsplit(":", 1)[0] if ":" in spec else spec


def _check_multi_turn(config: PPOConfig) -> list[str]:
    mt, key = config.worker.rollout.multi_turn, "worker.rollout.multi_turn"
    if not mt.enable:
        return []
    errors = []
    for name, value, low in (
        ("max_assistant_turns", mt.max_assistant_turns, 1),
        ("max_user_turns", mt.max_user_turns, 0),
        ("max_tool_response_tokens", mt.max_tool_response_tokens, 1),
        ("tool_workers", mt.tool_workers, 1),
        ("max_tool_images", mt.max_tool_images, 0),
    ):
        if value < low:
            errors.append(f"{key}.{name}={value} must be >= {low}")
    if mt.tool_timeout <= 0:
        errors.append(f"{key}.tool_timeout={mt.tool_timeout} must be > 0")
    if mt.format != "hermes":
        errors.append(f"{key}.format={mt.format!r} is unknown; the supported format is hermes")
    if not mt.tools and not mt.tool_config_path and not mt.interaction:
        errors.append(
            f"{key}.enable=true needs {key}.tools (path/to/file.py:function, ...), "
            f"{key}.tool_config_path or an interaction"
        )
    if mt.tool_config_path:
        from vlrl.rollout.multi_turn.tool_config import ToolConfigError, read_tool_config

        try:
            read_tool_config(mt.tool_config_path)
        except ToolConfigError as exc:
            errors.append(str(exc))
    for spec in [*mt.tools, *([mt.interaction] if mt.interaction else [])]:
        if not isinstance(spec, str) or not os.path.isfile(_spec_file(spec)):
            errors.append(f"{key}: tool/interaction file of {spec!r} does not exist")
    if config.worker.rollout.name != "vllm":
        errors.append(f"{key}.enable=true runs on the vLLM engine only: set worker.rollout.name=vllm")
    return errors


def _check_trainer(config: PPOConfig) -> list[str]:
    trainer = config.trainer
    errors = []
    bad = [name for name in trainer.logger if name not in KNOWN_LOGGERS]
    if bad:
        errors.append(f"trainer.logger has unknown entries {bad}; valid: {list(KNOWN_LOGGERS)}")
    for name in trainer.logger:
        package = LOGGER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            errors.append(
                f"trainer.logger includes {name!r}, but the {package!r} package is not installed: "
                f"pip install {package}, or drop {name} from trainer.logger"
            )
    if trainer.device not in ("cpu", "cuda"):
        errors.append(f"trainer.device={trainer.device!r} must be auto, cpu or cuda")
    if trainer.dist_timeout_minutes <= 0:
        errors.append(f"trainer.dist_timeout_minutes={trainer.dist_timeout_minutes} must be > 0")
    if trainer.max_steps is not None and trainer.max_steps < 1:
        errors.append(f"trainer.max_steps={trainer.max_steps} must be >= 1 (or null)")
    if trainer.val_blind_rows < 0:
        errors.append(f"trainer.val_blind_rows={trainer.val_blind_rows} must be >= 0 (0: off)")
    if trainer.total_epochs < 1:
        errors.append(f"trainer.total_epochs={trainer.total_epochs} must be >= 1")
    if not config.worker.actor.model.model_path:
        errors.append("worker.actor.model.model_path is required (a Hugging Face model folder)")
    if not config.data.train_files:
        errors.append("data.train_files is required")
    errors += _check_prompt_choice(config.data)
    if trainer.val_only and not config.data.val_files:
        errors.append("trainer.val_only=true validates and exits, and needs data.val_files")
    for key, value in (("data.format_prompt", config.data.format_prompt),):
        if value and not os.path.isfile(value):
            errors.append(f"{key}: file {value!r} does not exist")
    return errors


def _check_prompt_choice(data: DataConfig) -> list[str]:
    """data.sampler, revisit_share and train_weights (one positive weight per train_files entry)."""
    from vlrl.data.samplers import SAMPLERS
    from vlrl.data.sources import spec_entries

    errors = []
    if data.sampler not in SAMPLERS:
        errors.append(f"data.sampler={data.sampler!r} must be one of {', '.join(SAMPLERS)}")
    if not 0.0 <= data.revisit_share <= 1.0:
        errors.append(f"data.revisit_share={data.revisit_share} must be in [0, 1]")
    chooser = (
        "data.sampler=pass_rate"
        if data.sampler == "pass_rate"
        else "data.curriculum"
        if data.curriculum
        else None
    )
    if not data.shuffle and (chooser or data.train_weights is not None):
        errors.append(
            f"data.shuffle=false asks for file order, but {chooser or 'data.train_weights'} decides the order: "
            "leave data.shuffle at true"
        )
    if data.curriculum is not None:
        if data.curriculum != "pass_rate" and not (
            data.curriculum.startswith("column:") and data.curriculum[7:]
        ):
            errors.append(
                f"data.curriculum={data.curriculum!r} must be column:NAME (a numeric column) or pass_rate"
            )
        if data.curriculum_steps < 1:
            errors.append(
                "data.curriculum needs data.curriculum_steps >= 1 (the steps until all the data is in use)"
            )
        if not 0.0 < data.curriculum_start <= 1.0:
            errors.append(f"data.curriculum_start={data.curriculum_start} must be in (0, 1]")
        if data.train_weights is not None:
            errors.append("data.curriculum and data.train_weights are not combined: use one of them")
    if data.train_weights is not None:
        entries = spec_entries(data.train_files)
        if len(data.train_weights) != len(entries):
            errors.append(
                f"data.train_weights has {len(data.train_weights)} weights but data.train_files has "
                f"{len(entries)} entries ({entries}): give one weight per entry"
            )
        if any(w < 0 for w in data.train_weights) or sum(data.train_weights) <= 0:
            errors.append(f"data.train_weights={data.train_weights} must be >= 0 with a positive sum")
    return errors


# vLLM's cap on samples per prompt (vllm 0.32, vllm/sampling_params.py `_verify_num_sequences`; the
# default of vllm/envs.py), read here without importing vLLM.
VLLM_MAX_N_DEFAULT = 16384


def gradient_checkpointing_interval(policy: str) -> int:
    """K of a `worker.actor.model.gradient_checkpointing_layers` policy: every K-th layer is
    checkpointed ("all" is K = 1). ValueError for anything else."""
    if policy == "all":
        return 1
    match = re.fullmatch(r"every_k:(\d+)", policy.strip()) if isinstance(policy, str) else None
    if match is None or int(match.group(1)) < 1:
        raise ValueError(f'{policy!r} must be "all" or "every_k:K" with an integer K >= 1')
    return int(match.group(1))


def _check_gradient_checkpointing(config: PPOConfig) -> list[str]:
    """worker.actor.model.gradient_checkpointing_layers parses (checked even while checkpointing is
    off, so turning it on later cannot fail)."""
    policy = config.worker.actor.model.gradient_checkpointing_layers
    try:
        gradient_checkpointing_interval(policy)
    except ValueError as exc:
        return [f"worker.actor.model.gradient_checkpointing_layers={exc}"]
    return []


def _check_numbers(config: PPOConfig) -> list[str]:
    """Numbers out of their range or not finite, named by key (before anything starts)."""
    actor, rollout, trainer, algo = (
        config.worker.actor,
        config.worker.rollout,
        config.trainer,
        config.algorithm,
    )
    errors = []
    at_least_zero = {
        "worker.actor.optim.lr": actor.optim.lr,
        "worker.actor.optim.weight_decay": actor.optim.weight_decay,
        "worker.actor.entropy_coeff": actor.entropy_coeff,
        "algorithm.kl_coef": algo.kl_coef,
    }
    for key, value in at_least_zero.items():
        if not (math.isfinite(value) and value >= 0):
            errors.append(f"{key}={value} must be a finite number >= 0")
    clamp = algo.low_var_kl_clamp
    if clamp is not None and not (math.isfinite(clamp) and clamp > 0):
        errors.append(f"algorithm.low_var_kl_clamp={clamp} must be a finite number > 0, or null (no bound)")
    if algo.kl_loss_ratio_weighted and not algo.use_kl_loss:
        errors.append(
            "algorithm.kl_loss_ratio_weighted=true weights the KL loss, which is off: set "
            "algorithm.use_kl_loss=true (and disable_kl=false), or drop the key"
        )
    if not math.isfinite(actor.max_grad_norm):
        errors.append(f"worker.actor.max_grad_norm={actor.max_grad_norm} must be finite (<= 0: no clipping)")
    if not 0 < rollout.top_p <= 1:
        errors.append(f"worker.rollout.top_p={rollout.top_p} must be in (0, 1] (1: no nucleus truncation)")
    if rollout.top_k != -1 and rollout.top_k < 1:
        errors.append(f"worker.rollout.top_k={rollout.top_k} must be -1 (off) or >= 1")
    max_n = int(os.environ.get("VLLM_MAX_N_SEQUENCES", VLLM_MAX_N_DEFAULT))
    if not 1 <= rollout.n <= max_n:
        errors.append(
            f"worker.rollout.n={rollout.n} must be in [1, {max_n}] (vLLM's limit, VLLM_MAX_N_SEQUENCES)"
        )
    for key, value, meaning in (
        ("trainer.save_freq", trainer.save_freq, "-1 (only at the end) or N >= 1 (every N steps)"),
        ("trainer.save_limit", trainer.save_limit, "-1 (keep all) or N >= 1 (the newest N and the best)"),
        ("trainer.val_freq", trainer.val_freq, "-1 (only at the end) or N >= 1 (every N steps)"),
    ):
        if value == 0 or value < -1:
            errors.append(f"{key}={value} must be {meaning}")
    if trainer.max_failures < 0:
        errors.append(
            f"trainer.max_failures={trainer.max_failures} must be >= 0 (0: stop at the first failure)"
        )
    if not trainer.hang_timeout >= 0:
        errors.append(f"trainer.hang_timeout={trainer.hang_timeout} must be >= 0 (0: wait forever)")
    if not 0 <= config.worker.reward.max_failure_rate <= 1:
        errors.append(
            f"worker.reward.max_failure_rate={config.worker.reward.max_failure_rate} must be in [0, 1] (1: never stop)"
        )
    if actor.max_nonfinite_steps < 0:
        errors.append(
            f"worker.actor.max_nonfinite_steps={actor.max_nonfinite_steps} must be >= 0 (0: never stop)"
        )
    return errors


def _check_paths(config: PPOConfig) -> list[str]:
    """Model folders / hub ids and data files exist (or are reachable on the hub), in seconds."""
    from vlrl.config.paths import model_path_problem
    from vlrl.data.sources import DataError, resolve_files

    model = config.worker.actor.model
    errors = []
    paths = {"worker.actor.model.model_path": model.model_path}
    if model.tokenizer_path and model.tokenizer_path != model.model_path:
        paths["worker.actor.model.tokenizer_path"] = model.tokenizer_path
    for key, value in paths.items():
        problem = model_path_problem(value) if value else None
        if problem is not None:
            errors.append(f"{key}: {problem}")
    for key in ("train_files", "val_files"):
        spec = getattr(config.data, key)
        if spec:
            try:
                resolve_files(spec, check_hub=True)
            except DataError as err:
                errors.append(f"data.{key}: {err}")
    return errors
