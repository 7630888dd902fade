"""The configuration tree: `data`, `algorithm`, `worker.{actor,ref,rollout,reward}`, `trainer`.

Key names and most defaults follow EasyR1 so its YAML files and command lines carry over.
Each field's docstring is the string literal under it (shown by `--help`).

Loading order (see `vlrl.config.loader.load_config`): dataclass defaults, then `config=FILE.yaml`,
then dotted overrides `a.b.c=value`. Then `PPOConfig.finalize()` computes the derived values (in
`derive()`, the one place for them), runs every cross-field check (`validate()`) and freezes the tree.

Local paths: `derive()` makes relative local paths absolute against the folder the run was launched
from (`vlrl.config.paths.make_paths_absolute`, which lists the keys and states the rule): inputs that
exist there, and every output path; hub ids, Jinja strings and missing paths stay as written.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vlrl.config.device import ConfigError, resolve_device

if TYPE_CHECKING:
    from vlrl.algorithms.plan import StepPlan

logger = logging.getLogger(__name__)


class _Section:
    """Base of every config dataclass: can be frozen after `finalize()`."""

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"config is frozen; cannot set {type(self).__name__}.{name}")
        object.__setattr__(self, name, value)

    def freeze(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            child = getattr(self, f.name)
            if isinstance(child, _Section):
                child.freeze()
        object.__setattr__(self, "_frozen", True)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, _Section) else value
        return out


# --------------------------------------------------------------------------------------- data
@dataclass
class DataConfig(_Section):
    train_files: str | list[str] = ""
    """Training data: a .json/.jsonl/.parquet/.csv file, a folder of them, or `hub_name@split`; several
    as a comma list or a YAML list (each item an *entry*, which `train_weights` can weigh). Relative
    paths: from the launch folder (made absolute at start-up, see `vlrl.config.paths`)."""
    train_weights: list[float] | None = None
    """Weighted mixing: one weight per entry of `train_files` (normalised to shares). Each batch takes
    its prompts from the entries in these proportions (after any number of batches, each entry's
    share is within one prompt of its weight), whatever their sizes; rows of an entry come in a
    shuffled order renewed each time the entry is used up. Logs `source/<entry>/*` (share, reward,
    accuracy, response length) every step. None: the entries are one dataset, shuffled together."""
    sampler: str = "shuffle"
    """Which prompts a batch draws. shuffle: every prompt once per epoch, in a seeded shuffled order
    (`shuffle`, `seed`). pass_rate: prompts never drawn first, in the shuffle's first-epoch order
    (a first pass draws the shuffle's batches), then prompts whose groups are likely to disagree
    (GRPO learns only from those), by each prompt's pass rate (its `accuracy` reward, else
    `overall`, which must be in [0, 1]) as it would be now, following the policy's level as it
    learns; `revisit_share` of each batch is drawn uniformly once every prompt was seen. Its own
    choices start at step `len(data) // rollout_batch_size + 1` (said at start-up), so it pays only
    where prompts come back within a run. An epoch is then `len(data) / rollout_batch_size`
    batches, not every prompt once (docs/data.md, "Choosing prompts")."""
    curriculum: str | None = None
    """Easy to hard: `column:NAME` ranks prompts by a numeric column (low: easy), `pass_rate` by each
    prompt's pass rate against the policy that scored it (high: easy; unseen: average). Batches draw
    from the easiest `curriculum_start` of the data at first, growing linearly to all of it after
    `curriculum_steps` steps; within that pool uniformly, or by `sampler=pass_rate`. Not combined
    with `train_weights`. None: off."""
    curriculum_start: float = 0.25
    """Share of the data (the easiest) that the first batch draws from (0 to 1)."""
    curriculum_steps: int = 0
    """Steps until the whole data is in the pool (counted in loader batches: one per step unless
    online filtering or `mini_rollout_batch_size` draws more); required (>= 1) with `curriculum`."""
    revisit_share: float = 0.1
    """sampler=pass_rate: share of a batch (of its slots left after the prompts never drawn) drawn
    uniformly from the prompts seen, so that solved and hopeless prompts are tried again as the
    policy changes (0 to 1)."""
    val_files: str = ""
    """Validation data, same forms as `train_files`; empty disables validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt text; `<image>`/`<video>` mark where each image/video goes."""
    answer_key: str = "answer"
    """Column holding the ground truth passed to the reward function."""
    image_key: str = "images"
    """Column holding a list of images (paths, PIL images, {'bytes': ...} dicts or raw bytes)."""
    video_key: str = "videos"
    """Column holding a list of videos, one per `<video>` marker: each a video file path (read with
    PyAV) or a list of frame images (see docs/data.md, "Video")."""
    image_dir: str | None = None
    """Folder prepended to relative image paths; default: the data file's folder."""
    video_fps: float = 2.0
    """Frames per second sampled from video files (qwen-vl-utils' rule: 4 to 768 frames, an even
    count); a list of frames is taken whole, as sampled at this rate. Each frame is sized within
    `min_pixels` / `max_pixels` (at most 768 tokens per frame)."""
    max_prompt_length: int = 512
    """Maximum prompt length in tokens, counted after image tokens are expanded."""
    max_response_length: int = 512
    """Maximum number of generated tokens per response."""
    rollout_batch_size: int = 512
    """Prompts per training step (each sampled `worker.rollout.n` times)."""
    mini_rollout_batch_size: int | None = None
    """Prompts drawn per generation round; a step draws rounds until it holds `rollout_batch_size`
    groups (after online filtering, when on; each round counts toward `trainer.max_try_make_batch`)
    and cuts off the excess. None: one round of `rollout_batch_size` prompts."""
    val_batch_size: int = -1
    """Prompts per validation generation call; -1: the whole validation set at once."""
    format_prompt: str | None = None
    """Jinja template (file path) applied to the prompt text; the text is the variable `content`.
    Relative: from the launch folder."""
    override_chat_template: str | None = None
    """Chat template (Jinja string or file path) used instead of the tokenizer's."""
    shuffle: bool = True
    """Shuffle the training data every epoch (seeded by `seed`)."""
    seed: int = 1
    """Seed of the data order."""
    min_pixels: int | None = 262144
    """Images (and video frames) with fewer pixels are upscaled to at least this many (Qwen-VL rule,
    multiples of 28)."""
    max_pixels: int | None = 4194304
    """Images (and video frames) with more pixels are downscaled to at most this many."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than `max_prompt_length` (counted in the logs); False: such a row is an error."""
    filter_overlong_prompts_workers: int = 16
    """Threads that tokenize prompts for the start-up length check (the tokenizer releases the GIL)."""
    skip_bad_rows: bool = False
    """Skip (and count) bad rows (missing or undecodable images, mismatched `<image>` markers, ...)
    instead of failing, at start-up and when a row fails later (replaced by another row of the epoch)."""
    image_check_cache_dir: str | None = None
    """Folder of the start-up image check's cache (images already decoded once, keyed by path, size and
    mtime or by content hash); None: `$XDG_CACHE_HOME/vlrl/image_checks` (`~/.cache/vlrl/image_checks`)."""


# ---------------------------------------------------------------------------------- algorithm
@dataclass
class AlgorithmConfig(_Section):
    adv_estimator: str = "grpo"
    """Advantage estimator: grpo, dr_grpo, rloo, reinforce_plus_plus, remax, grpo_passk (all
    critic-free: EasyR1's gae, which needs a value model, is not implemented)."""
    gamma: float = 1.0
    """Discount factor (reinforce_plus_plus)."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides by the group's std; False gives Dr.GRPO's plain mean-centering."""
    disable_kl: bool = False
    """Turn off every KL term (no reference policy is loaded). It wins over `use_kl_loss`, as in
    EasyR1 (whose config.yaml sets `use_kl_loss: true` and whose DAPO recipes add `disable_kl=True`):
    the loaded config then reads `use_kl_loss: false`."""
    use_kl_loss: bool = False
    """Add `kl_coef * KL(policy || ref)` to the loss (GRPO style); False: KL penalty in the reward."""
    kl_penalty: str = "kl"
    """KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3, bounded by `low_var_kl_clamp`), full."""
    low_var_kl_clamp: float | None = 10.0
    """Bound of the per-token k3 estimate (`kl_penalty=low_var_kl`), as EasyR1 bounds it; None: none.
    A token beyond it gets no KL gradient, and those are the tokens farthest from the reference
    (share logged as `actor/kl_clamped_share`; docs/algorithms.md). Must be > 0."""
    kl_loss_ratio_weighted: bool = False
    """Multiply each token's KL loss by its ratio pi / pi_old, kept in the graph (needs
    `use_kl_loss`). The k3 loss alone has the gradient of KL(pi_ref || pi) in expectation; weighted,
    that of KL(pi || pi_ref), the KL it estimates (TRL's `use_bias_correction_kl`, on by default
    there since TRL 1.x; EasyR1 does not weight). docs/algorithms.md."""
    kl_coef: float = 1e-3
    """KL coefficient (initial value for the adaptive controller)."""
    kl_type: str = "fixed"
    """KL controller for the reward penalty: fixed or adaptive."""
    kl_horizon: float = 10000.0
    """Adaptive KL controller horizon."""
    kl_target: float = 0.1
    """Adaptive KL controller target KL."""
    tis_cap: float | None = None
    """Truncated importance sampling per token: each token's advantage is scaled by
    min(pi_old / pi_rollout, tis_cap), the (detached) ratio of the actor's old log-prob to the
    engine's, so the update corrects for the gap between the policy that sampled and the one being
    trained (asynchronous mode's lag, or engine numerics). The shorthand for
    off_policy_correction=token_tis with correction_bound=tis_cap. None: off."""
    off_policy_correction: str | None = None
    """A preset weighting of the advantages by r = pi_old / pi_rollout per sampled token (bound C =
    correction_bound): token_tis min(r, C); seq_tis min(product of the sequence's r, C); token_mask
    drops tokens with r outside [1/C, C]; seq_mask drops sequences whose geometric-mean r is outside
    it (vlrl/algorithms/importance.py). Logs off_policy/ratio_mean, ratio_max, weight_mean and
    truncated_frac or masked_frac. Needs worker.rollout.calculate_log_probs. None: off."""
    correction_bound: float = 2.0
    """C of off_policy_correction: the truncation cap (tis presets, > 0) or the band [1/C, C]
    (mask presets, > 1)."""
    old_policy: str = "auto"
    """The policy the PPO ratio (and its clip) is measured from. actor: the actor's log-probs of the
    sampled tokens, recomputed before the update (EasyR1's). rollout: the engine's log-probs, i.e. the
    policy that sampled. In asynchronous mode the batch was sampled one update ago: a ratio measured
    from the actor lets each step move a full clip range beyond where the previous update already
    took the policy, and on the quickstart that overshoot sank one seed in four (docs/async.md); from
    the sampling policy the clip bounds the whole move. Needs worker.rollout.calculate_log_probs; not
    with tis_cap (the ratio itself then corrects for the sampling policy). auto: rollout in
    asynchronous mode when the engine's log-probs are computed and tis_cap is off, else actor."""
    online_filtering: bool = False
    """DAPO dynamic sampling: drop groups whose mean `filter_key` reward is not in (filter_low, filter_high)."""
    filter_key: str = "overall"
    """Reward part used by online filtering."""
    filter_low: float = 0.01
    """Groups whose mean reward is <= this are dropped."""
    filter_high: float = 0.99
    """Groups whose mean reward is >= this are dropped."""


# ------------------------------------------------------------------------------------- worker
@dataclass
class LoraConfig(_Section):
    rank: int = 0
    """LoRA rank; 0 trains all weights, > 0 trains low-rank adapters only (built on peft)."""
    alpha: int = 64
    """LoRA scaling numerator: the adapter's update is scaled by alpha / rank."""
    target_modules: str = "all-linear"
    """Modules that get adapters: "all-linear" or a comma list such as "q_proj,k_proj,v_proj,o_proj"."""
    exclude_modules: str | None = None
    """Regex of module names that never get adapters (the vision tower is always excluded)."""


@dataclass
class ModelConfig(_Section):
    model_path: str = ""
    """Hugging Face model folder (or hub name) of the policy. A relative folder that exists in the
    launch folder is made absolute at start-up (Ray ranks run elsewhere); a hub id such as
    `Qwen/Qwen2.5-VL-7B-Instruct` stays as given (the rule: `vlrl.config.paths`)."""
    tokenizer_path: str | None = None
    """Tokenizer/processor folder; default: `model_path`."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Entries that override the model's config.json (e.g. {"attention_dropout": 0.0})."""
    enable_gradient_checkpointing: bool = True
    """Recompute activations in the backward pass (saves memory, costs ~30% compute); which layers:
    `gradient_checkpointing_layers`."""
    gradient_checkpointing_layers: str = "all"
    """Layers `enable_gradient_checkpointing` recomputes: "all" (every decoder layer and vision
    block), or "every_k:K" (layers 0, K, 2K, ... of the decoder and, counted apart, of the vision
    tower: about 1/K of the recompute cost, the other layers keep their activations).
    Ignored when `enable_gradient_checkpointing` is false."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the model folder."""
    freeze_vision_tower: bool = False
    """Keep the vision encoder's weights fixed."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning."""


@dataclass
class OptimConfig(_Section):
    lr: float = 1e-6
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    weight_decay: float = 1e-2
    """AdamW weight decay."""
    strategy: str = "adamw"
    """Optimizer: adamw, or adamw_bf16 (optimizer states in bf16)."""
    lr_warmup_ratio: float = 0.0
    """Warm-up length as a fraction of the training steps."""
    lr_warmup_steps: int | None = None
    """Warm-up length in trainer steps (overrides `lr_warmup_ratio`); the LR still rises with every
    optimizer step inside them. None: `lr_warmup_ratio`'s, except with `worker.rollout.max_staleness`
    >= 2 and the ratio from the sampling policy, where a ratio of 0 gives 5 steps (Adam's first
    steps on a batch sampled several updates back can take the policy to near-uniform)."""
    lr_scheduler_type: str = "constant"
    """Schedule after warm-up: constant or cosine."""
    min_lr_ratio: float | None = None
    """Cosine schedule floor, as a fraction of `lr`; None: 0."""


@dataclass
class FSDPConfig(_Section):
    enable_full_shard: bool = True
    """Shard parameters (FSDP2 reshard after forward); False keeps them gathered (faster, more memory)."""
    enable_cpu_offload: bool = False
    """Let FSDP2 keep parameters on CPU (GPU only)."""
    torch_dtype: str | None = None
    """Dtype of the master weights: fp32/float32 (default for training) or bf16/bfloat16 (pure bf16)."""
    mp_param_dtype: str = "bf16"
    """Mixed-precision compute dtype on GPU (ignored on CPU, which computes in float32)."""
    mp_reduce_dtype: str = "fp32"
    """Gradient reduction dtype."""
    mp_buffer_dtype: str = "fp32"
    """Dtype of buffers (rotary frequencies): only fp32 is supported (FSDP2 does not cast buffers)."""
    enable_rank0_init: bool = True
    """Rank 0 reads the weights from disk and the other ranks receive them (one disk read);
    False: every rank reads the whole checkpoint itself."""
    use_orig_params: bool = False
    """Accepted for EasyR1 configs: FSDP2 always keeps the original parameters, whatever the value."""
    fsdp_size: int = -1
    """Ranks per sharding group; must divide the training ranks. Smaller than them: hybrid sharding
    (HSDP), groups of consecutive ranks each hold one sharded copy and average gradients across
    groups, so weight gathers stay inside a group. -1: the ranks per node with several nodes (when
    they divide the training ranks), else all ranks (one flat group)."""


@dataclass
class OffloadConfig(_Section):
    offload_params: bool = False
    """Move the parameters to CPU while the rollout engine runs (GPU only)."""
    offload_optimizer: bool = False
    """Move the optimizer states to CPU between updates (GPU only)."""


@dataclass
class ActorConfig(_Section):
    strategy: str = "fsdp"
    """Training strategy: fsdp (FSDP2); anything else fails at start-up."""
    global_batch_size: int = 256
    """Prompts per optimizer step (mini-batch), across all ranks; each prompt brings n samples."""
    micro_batch_size_per_device_for_update: int = 4
    """Samples per forward/backward in the update (per rank). With dynamic batching (the default)
    and no `max_token_len_per_device`, it sets the update's token budget: this many rows of the
    batch's padded width."""
    micro_batch_size_per_device_for_experience: int = 16
    """Samples per forward when computing old/ref log-probs (per rank); with dynamic batching and no
    `max_token_len_per_device`, the log-prob passes' token budget in rows of the padded width."""
    max_grad_norm: float = 1.0
    """Gradient-norm clipping threshold."""
    clip_ratio_low: float = 0.2
    """PPO lower clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.3
    """PPO upper clip: ratio <= 1 + clip_ratio_high (DAPO clip-higher)."""
    clip_ratio_dual: float | None = None
    """Dual-clip bound for negative advantages (must be > 1). None: 3.0, or 1 + `clip_ratio_high`
    when the ratio is measured from a policy two or more updates old (asynchronous mode with
    `worker.rollout.max_staleness` >= 2 and the ratio from the sampling policy): a token is then
    pushed only while its ratio to the sampling policy is inside the clip range, whatever its
    advantage's sign (docs/async.md, "a trust region around the sampling policy")."""
    policy_loss: str = "ppo"
    """Policy loss: ppo (vanilla/dual-clip), gspo, gspo_token, cispo, sapo. EasyR1's
    `worker.actor.loss_type` is an alias (its `default` is ppo)."""
    tau_positive: float = 1.0
    """SAPO gate temperature for tokens with positive advantages."""
    tau_negative: float = 1.05
    """SAPO gate temperature for tokens with negative advantages (larger: the gate decays faster)."""
    loss_avg_mode: str = "token"
    """Loss aggregation: token (mean over all tokens), seq (mean of per-sequence means), seq-mean-token-sum."""
    ppo_epochs: int = 1
    """Passes over each step's data."""
    padding_free: bool = True
    """Pack sequences without padding in the actor's forward passes."""
    dynamic_batching: bool = True
    """Form micro-batches by a token budget (`max_token_len_per_device`) instead of a sample count,
    in the update and both log-prob passes (actor, reference), as EasyR1 does by default. Rows are
    packed deterministically (longest first, token-balanced, the same count on every rank); the
    loss is still normalized per mini-batch, so only the summation order differs from fixed
    micro-batches. false: `micro_batch_size_per_device_for_*` rows per micro-batch."""
    max_token_len_per_device: int | None = None
    """Token budget per micro-batch with dynamic batching (real tokens when padding_free, else the
    padded width per row); a longer row gets a micro-batch of its own. None: the micro-batch size
    (`micro_batch_size_per_device_for_update` in the update, `..._for_experience` in the log-prob
    passes) times the widest row of the batch being split (EasyR1's rule): a micro-batch then never
    holds more tokens than a fixed micro-batch of that many padded rows, so peak activation memory
    stays what the micro-batch size was tuned for, while short responses share a forward. Per
    device: with ulysses_size > 1 a micro-batch holds up to ulysses_size times as many tokens.
    Setting it with dynamic_batching=false fails at start-up (it would be ignored)."""
    ulysses_size: int = 1
    """Ulysses sequence parallelism: groups of this many ranks get the same rows and each runs 1/size
    of every packed micro-batch's tokens (attention exchanges heads for tokens with all-to-alls), so
    activation memory per rank falls by about this factor. Must divide the world size and the text
    decoder's attention heads (key/value heads: divide or be divided by it); needs padding_free.
    Applies to the actor and the reference. Data parallelism is over world / ulysses_size groups."""
    use_torch_compile: bool = False
    """Compile the per-token log-prob/entropy function with torch.compile (also for the reference)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (0 disables the extra pass)."""
    skip_steps_without_advantage: bool = True
    """Skip the optimizer step of a mini-batch whose advantages are all 0 on every rank (every
    group's rewards equal): its gradient then holds only the entropy/KL terms, which Adam rescales
    to a full-size step, and its second moments decay. The LR schedule still advances; counted as
    `actor/no_advantage_steps`. Without it the 600-step quickstart collapsed to chance (see
    docs/algorithms.md); EasyR1 always steps."""
    max_nonfinite_steps: int = 5
    """Stop the run after this many optimizer steps in a row whose gradient norm is inf/nan (each is
    skipped and counted in `actor/skipped_steps`); 0: never stop. A step that makes the weights
    inf/nan always stops the run, before they can be saved."""
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)


@dataclass
class RefConfig(_Section):
    strategy: str = "fsdp"
    """Sharding strategy of the reference: fsdp (FSDP2); anything else fails at start-up."""
    micro_batch_size_per_device_for_experience: int | None = None
    """Samples per forward when computing reference log-probs (per rank); None: the actor's."""
    padding_free: bool | None = None
    """Pack sequences without padding; None: as the actor."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the reference (its own; not the actor's). On GPU the weights are kept in bf16
    unless `torch_dtype` says otherwise (no optimizer needs fp32 master weights)."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """`offload_params`: keep the reference weights on CPU and move them in only for its forward
    (GPU only). `offload_optimizer` has nothing to act on (the reference has no optimizer)."""


@dataclass
class MultiTurnConfig(_Section):
    enable: bool = False
    """Multi-turn rollouts: the model may call tools (and an interaction may answer as the user)
    before its final answer; see docs/multi_turn.md. Off: single-turn generation, unchanged."""
    max_assistant_turns: int = 4
    """Most assistant turns per trajectory (each turn ends at a tool call or at EOS)."""
    max_user_turns: int = 2
    """Most interaction (user) replies per trajectory."""
    tools: list[str] = field(default_factory=list)
    """Tool functions, `path/to/file.py:function` each; the schema comes from the signature and docstring.
    Relative: from the launch folder (made absolute at start-up: the ranks run the tools)."""
    tool_config_path: str | None = None
    """YAML file of tools with OpenAI-style schemas (`tools: [{callable: file.py:fn, tool_schema:
    {type: function, function: {...}}}]`, paths relative to the YAML); adds to `tools`. Each schema
    is checked against its function's signature at start-up. Format: docs/multi_turn.md."""
    interaction: str | None = None
    """`path/to/file.py:function` called after each final assistant turn; may reply as the user or end."""
    max_tool_response_tokens: int = 256
    """Text tokens of one tool response kept (longer text is cut, counted as `multi_turn/tool_truncated`)."""
    tool_timeout: float = 30.0
    """Seconds one tool call may take; a hung tool is killed and the model is told it timed out."""
    tool_workers: int = 4
    """Tool worker processes per engine (tools run isolated, in parallel); with tensor parallelism
    they run on the engine's first rank only, which sends the results to the other ranks."""
    max_tool_images: int = 1
    """Most images one tool call may return (also sizes the engine's images per request)."""
    format: str = "hermes"
    """Tool-call format: hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)."""
    tools_kwargs_key: str = "tools_kwargs"
    """Dataset column with per-row tool context: {tool name: {keyword: value}}, passed to the tool's
    keyword-only parameters (hidden from the model)."""
    overlap_tools: bool = False
    """Run tool calls while the engine keeps decoding the other samples; a sample's next turn starts
    at the first step after its call returns. Hides slow tools, but which step that is depends on
    timing, so sampling is no longer reproducible on CPU engines (GPU engines seed each request).
    Off: calls run between engine steps and the run is deterministic. With tensor parallelism the
    first rank's timing decides for every rank of the engine."""


@dataclass
class RolloutConfig(_Section):
    name: str = "vllm"
    """Rollout engine: vllm (SPMD, one engine per rank) or hf (transformers generate; slow, for debugging)."""
    n: int = 1
    """Responses sampled per prompt (the GRPO group size; grpo and rloo need >= 2)."""
    temperature: float = 1.0
    """Sampling temperature (also applied to the log-probs the actor computes)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    seed: int = 1
    """Sampling seed; data-parallel groups add their index, tensor-parallel peers share it."""
    ignore_eos: bool = False
    """Keep generating past EOS up to the maximum length."""
    limit_images: int = 0
    """Maximum images per prompt the engine accepts; 0: derived from the data."""
    dtype: str = "bf16"
    """Engine weight dtype: bf16, fp16 or fp32."""
    gpu_memory_utilization: float = 0.6
    """Fraction of device memory for the engine (on CPU: of host RAM; keep it small). Rollout-only
    ranks of asynchronous mode take at least 0.85 of their GPU (nothing else lives there)."""
    enforce_eager: bool = False
    """Disable CUDA graphs (always eager on CPU)."""
    enable_chunked_prefill: bool = False
    """Let vLLM split long prefills."""
    enable_sleep_mode: bool = True
    """Free the engine's weights and KV cache while the actor trains (GPU only; ignored on CPU)."""
    tensor_parallel_size: int = 1
    """Ranks per engine (must divide the world size)."""
    max_model_len: int | None = None
    """Engine context length; default: max_prompt_length + max_response_length."""
    max_num_batched_tokens: int = 8192
    """Tokens per engine scheduler step."""
    max_num_seqs: int = 256
    """Sequences per engine scheduler step."""
    calculate_log_probs: bool = True
    """Return the engine's sampled-token log-probs: every step then logs `rollout/log_prob_diff_*`
    (engine vs actor on the same tokens) and warns on drift. (EasyR1's default is false; the cost
    is one log-softmax per decoding step.)"""
    log_prob_diff_warn: float = 0.05
    """Warn when the mean |engine - actor| log-prob of a step exceeds this (nats per token): the
    actor is then not scoring the policy that sampled (stale weights, a different distribution).
    bf16 engines typically differ by ~0.01."""
    disable_tqdm: bool = False
    """Hide the engine's per-call progress bar (shown on rank 0 only, and only when the driver
    writes to a terminal or VLRL_DEBUG is set: piped into a log, each bar is a few lines per call)."""
    disable_log_stats: bool = True
    """Keep vLLM from logging its engine statistics (throughput, KV-cache use) periodically."""
    sync_bucket_mb: int = 256
    """Weight-sync bucket size in MiB: bounds the extra memory of one sync."""
    async_ranks: int = 0
    """Asynchronous mode when > 0: the last `async_ranks` ranks only generate and the others only
    train, so the generation of step k+1 overlaps the update of step k; after each update the
    weights are broadcast to them (docs/async.md). 0: every rank trains and generates, one phase
    after the other (the default)."""
    max_staleness: int = 1
    """Asynchronous mode: updates the sampling policy may lag the trained one (generation runs up to
    k steps ahead, weights sent in the background for k >= 2; docs/async.md); 0: no overlap."""
    partial_rollouts: bool = False
    """Asynchronous mode, `max_staleness` >= 2: engines take new weights between two engine steps,
    inside a generation; each token records the policy version that sampled it (docs/async.md)."""
    val_override_config: dict[str, Any] = field(default_factory=dict)
    """Sampling overrides for validation (keys: n, temperature, top_p, top_k, seed, ignore_eos);
    empty: validation samples as training does."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn, tool-using rollouts (off by default)."""


@dataclass
class RewardConfig(_Section):
    reward_type: str | None = None
    """batch (a list of inputs per call) or sequential (one input per call); None: the file's
    `REWARD_TYPE` attribute if it declares one, else batch."""
    reward_function: str | None = None
    """`path/to/file.py:function` (no `:function` means `main`). Relative: from the launch folder."""
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the reward function."""
    skip_special_tokens: bool = True
    """Decode responses without special tokens."""
    num_workers: int = 1
    """Reward worker processes of each generating rank (the first rank of each engine scores the rows
    it generated, off its own process) and of the driver (which scores a reward that must see the
    whole batch, and rows read back from a checkpoint); 0: in those processes themselves (debugging,
    no timeout). EasyR1's `worker.reward.num_cpus` is an alias."""
    timeout: float = 60.0
    """Seconds one reward call may take before it counts as a failure."""
    on_failure: str = "raise"
    """What a failing sample does: raise (stop with the file, function and sample) or zero (score 0,
    counted). A worker that dies while scoring is replaced and its unanswered samples are tried once
    more on the fresh worker first."""
    max_failure_rate: float = 0.5
    """With on_failure=zero: stop the run when more than this share of one step's samples fail (a
    reward that is broken, not flaky, would otherwise train on zeros). 1.0: never stop."""
    streaming: bool = True
    """Score each group as soon as its samples are generated, while the rest of the rank's batch is
    still generating (vLLM, single-turn; the HF engine and multi-turn rollouts report their groups at
    the end). The batch and its scores are the same either way: a batch reward function is streamed
    only when its file declares `PARTIAL_BATCHES = True`; otherwise the driver gives it the whole
    batch after generation."""
    memory_limit_mb: int | None = None
    """Cap on each reward worker's address space in MiB (RLIMIT_AS, set before the reward file is imported,
    so its imports count too): an allocation past it raises MemoryError in the reward, reported as out of
    memory, instead of the machine swapping or the OOM killer ending the worker. None: no cap. Needs num_workers >= 1."""


@dataclass
class WorkerConfig(_Section):
    hybrid_engine: bool = True
    """Actor, rollout and reference share each rank. Only true is supported (false fails at start-up;
    separate rollout ranks are `worker.rollout.async_ranks`)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


# ------------------------------------------------------------------------------------ trainer
@dataclass
class TrainerConfig(_Section):
    total_epochs: int = 15
    """Passes over the training data."""
    max_steps: int | None = None
    """Train this many steps; `total_epochs` is then ignored (the data repeats as needed)."""
    project_name: str = "vlrl"
    """Project name (wandb project, default output folder)."""
    experiment_name: str = "demo"
    """Run name."""
    logger: list[str] = field(default_factory=lambda: ["console", "file"])
    """Loggers: any of console, file, wandb, tensorboard, swanlab, mlflow."""
    nnodes: int = 1
    """Nodes in the Ray cluster to use."""
    n_gpus_per_node: int = 8
    """Ranks per node: GPUs per node, or CPU ranks on a machine without GPUs."""
    device: str = "auto"
    """auto, cuda or cpu. auto: cuda when the Ray cluster named by RAY_ADDRESS has GPUs (without
    RAY_ADDRESS: when torch can use one on this machine), else cpu. NVIDIA GPUs that torch cannot use
    (`nvidia-smi` lists them, but the driver is too old for torch's CUDA build: CUDA 13.0 needs driver
    >= 580) stop the run at start-up with the driver version; cpu trains on the CPU anyway."""
    max_failures: int = 0
    """Restart the rank workers and resume from this run's latest checkpoint when a rank worker dies
    or hangs (`hang_timeout`), up to this many times in a run, each logged (as Ray Train's
    `FailureConfig.max_failures`). An error raised by the step's code stops the run at once: it
    would happen again. 0: stop at the first failure."""
    hang_timeout: float = 1800.0
    """Seconds a call to the rank workers (generation, log-probs, update, save ...) may run before the
    run stops as hung, naming the ranks that did not answer with their pid and host: the limit is
    max(hang_timeout, 10 x the longest the same call took earlier in the run), so it grows with
    measured step times. The first call of each kind (model loading, the first generation) must
    finish within hang_timeout; a generation includes the rank's wait for its rewards. 0: wait forever."""
    dist_timeout_minutes: float = 60.0
    """Timeout of the ranks' collectives (torch.distributed). Generous by default: rank 0 reads the
    whole checkpoint from disk while the other ranks wait in the weight broadcast."""
    max_try_make_batch: int = 20
    """With online filtering: generation rounds allowed to fill one batch (-1: unlimited)."""
    val_freq: int = -1
    """Validate every N steps (-1: only at the end)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    val_only: bool = False
    """Validate and exit."""
    val_generations_to_log: int = 0
    """Validation generations written to the loggers each validation."""
    val_blind_rows: int = 32
    """Does the model look at the image? At each validation the first N prompts with images of the
    first validation batch (`val_batch_size`) are generated again with every image blanked (grey)
    and with another row's images; logs val/blind_accuracy, val/swapped_accuracy (or _overall
    without an accuracy reward) and their gaps to the same prompts' real score, and warns when
    validation improved but the blank-image gap stayed small (vlrl/trainer/visual_reliance.py).
    0: off."""
    save_freq: int = -1
    """Checkpoint every N steps (-1: only at the end)."""
    save_limit: int = -1
    """Keep the newest N checkpoints plus the best (-1: keep all)."""
    save_model_only: bool = False
    """Save only the model weights (no optimizer/dataloader state: cannot resume exactly)."""
    save_checkpoint_path: str | None = None
    """Checkpoint folder; default: checkpoints/{project_name}/{experiment_name}. Relative: from the
    launch folder, made absolute at start-up (`~` expanded), because every rank writes here and a Ray
    rank runs in its raylet's folder; on several nodes it must be storage all of them see."""
    load_checkpoint_path: str | None = None
    """Resume from this checkpoint (a `global_step_N` folder)."""
    find_last_checkpoint: bool = True
    """Resume from the newest complete checkpoint in `save_checkpoint_path` when one exists."""
    overwrite_checkpoints: bool = False
    """Let a run that does not resume (`find_last_checkpoint=false`, or `load_checkpoint_path` outside
    the folder) start in a `save_checkpoint_path` holding an earlier run's checkpoints; without it
    such a run stops at start-up. They are kept until this run's first checkpoint is complete, then
    removed with their tracker, so the folder never mixes two runs and a run that fails earlier loses
    nothing (`logs/` is kept and appended to). A run that resumes from the folder ignores it."""
    ray_timeline: str | None = None
    """Write Ray's task timeline (Chrome trace JSON) to this file at the end of the run."""
    plot_path: str | None = None
    """Write a PNG of reward and response length per step here at the end."""


# --------------------------------------------------------------------------------------- root
@dataclass
class PPOConfig(_Section):
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    # ---- derived values: computed here and nowhere else
    @property
    def world_size(self) -> int:
        """Training ranks: nodes x ranks per node."""
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def train_world_size(self) -> int:
        """Ranks that train: all of them, or all but `worker.rollout.async_ranks` in asynchronous mode."""
        return self.world_size - self.worker.rollout.async_ranks

    @property
    def rollout_world_size(self) -> int:
        """Ranks that generate: all of them, or `worker.rollout.async_ranks` in asynchronous mode."""
        return self.worker.rollout.async_ranks or self.world_size

    @property
    def samples_per_step(self) -> int:
        """Sequences generated per step: prompts x n."""
        return self.data.rollout_batch_size * self.worker.rollout.n

    @property
    def optimizer_steps_per_step(self) -> int:
        """Actor optimizer steps per trainer step: mini-batches (rollout_batch_size /
        global_batch_size) x ppo_epochs."""
        actor = self.worker.actor
        return max(self.data.rollout_batch_size // max(actor.global_batch_size, 1), 1) * actor.ppo_epochs

    @property
    def samples_per_minibatch_per_rank(self) -> int:
        """Sequences each rank feeds one optimizer step."""
        return self.worker.actor.global_batch_size * self.worker.rollout.n // self.dp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel groups of the actor: ranks / worker.actor.ulysses_size (a group's ranks get
        the same rows)."""
        return self.train_world_size // max(self.worker.actor.ulysses_size, 1)

    @property
    def plan(self) -> StepPlan:
        """The step plan (vlrl.algorithms.plan): which log-probs a step computes, where the KL and
        the advantages go, the baseline and the corrections; derived from the keys, the one place
        that decides them."""
        from vlrl.algorithms.plan import step_plan

        return step_plan(self)

    def derive(self) -> None:
        """Fill the values that default to other values. The one place for derived config."""
        rollout, model = self.worker.rollout, self.worker.actor.model
        if self.algorithm.disable_kl:  # no reference, so no KL term of any kind (EasyR1's meaning)
            self.algorithm.use_kl_loss = False
        algo = self.algorithm
        if algo.tis_cap is not None and algo.off_policy_correction is None:  # the shorthand
            algo.off_policy_correction, algo.correction_bound = "token_tis", algo.tis_cap
        if self.algorithm.old_policy == "auto":
            lagged = (
                rollout.async_ranks > 0 and rollout.calculate_log_probs and algo.off_policy_correction is None
            )
            self.algorithm.old_policy = "rollout" if lagged else "actor"
        self._stale_trust_region()
        if rollout.max_model_len is None:
            rollout.max_model_len = self.data.max_prompt_length + self.data.max_response_length
        if model.tokenizer_path is None:
            model.tokenizer_path = model.model_path
        ref, actor = self.worker.ref, self.worker.actor
        if ref.micro_batch_size_per_device_for_experience is None:
            ref.micro_batch_size_per_device_for_experience = actor.micro_batch_size_per_device_for_experience
        if ref.padding_free is None:
            ref.padding_free = actor.padding_free
        if self.trainer.save_checkpoint_path is None:
            self.trainer.save_checkpoint_path = os.path.join(
                "checkpoints", self.trainer.project_name, self.trainer.experiment_name
            )
        if self.trainer.device == "auto":
            self.trainer.device = resolve_device(os.environ.get("RAY_ADDRESS"))
        for fsdp in (actor.fsdp, ref.fsdp):
            fsdp.fsdp_size = self._default_fsdp_size(fsdp.fsdp_size)
        self._absolute_local_paths()

    def _stale_trust_region(self) -> None:
        """The defaults of `clip_ratio_dual` and `lr_warmup_steps`: with the ratio measured from a
        policy two or more updates old they bound every token's push to the clip range around the
        sampling policy and warm the LR up over 5 steps (measured: docs/async.md, where k = 2 and
        4 without them stalled or collapsed on some seeds); otherwise EasyR1's (3.0, no warm-up).
        Explicit values win; the choice is logged."""
        actor, rollout = self.worker.actor, self.worker.rollout
        stale = (
            rollout.async_ranks > 0 and rollout.max_staleness >= 2 and self.algorithm.old_policy == "rollout"
        )
        chosen = []
        if actor.clip_ratio_dual is None:
            actor.clip_ratio_dual = 1.0 + actor.clip_ratio_high if stale else 3.0
            chosen.append(f"worker.actor.clip_ratio_dual={actor.clip_ratio_dual:g}")
        optim = actor.optim
        if stale and optim.lr_warmup_steps is None and optim.lr_warmup_ratio == 0:
            optim.lr_warmup_steps = 5
            chosen.append("worker.actor.optim.lr_warmup_steps=5")
        if stale and chosen:
            logger.info(
                "worker.rollout.max_staleness=%d with the ratio from the sampling policy: %s "
                "(a trust region around the sampling policy, docs/async.md; set them to override)",
                rollout.max_staleness,
                " ".join(chosen),
            )

    def _default_fsdp_size(self, fsdp_size: int) -> int:
        """`fsdp_size` -1 on several nodes: one sharding group per node (ranks r*n .. r*n+n-1 share a
        node, vlrl.trainer.ray_workers.rank_placement), so the per-layer all-gathers stay on the node
        and only gradient all-reduces cross nodes. Flat when a node's ranks do not divide the
        training ranks (asynchronous mode can leave a node partly training)."""
        per_node, train = self.trainer.n_gpus_per_node, self.train_world_size
        if fsdp_size != -1 or self.trainer.nnodes <= 1 or per_node >= train or train % per_node:
            return fsdp_size
        return per_node

    def _absolute_local_paths(self) -> None:
        """Relative local paths made absolute against the launch folder (the rule:
        `vlrl.config.paths`): a Ray rank worker runs in its raylet's folder, so `ray start` run
        elsewhere (or another node) would read a relative path from there. Each change is logged."""
        from vlrl.config.paths import make_paths_absolute

        changed = make_paths_absolute(self)
        if changed:
            lines = "".join(f"\n  {key}: {before} -> {after}" for key, before, after in changed)
            logger.info("local paths made absolute against the launch folder %s:%s", os.getcwd(), lines)

    def validate(self) -> None:
        """Every cross-field rule, each failure naming the keys and what to change."""
        from vlrl.config.checks import check_config

        errors = check_config(self)
        if errors:
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))

    def finalize(self) -> PPOConfig:
        """Derive, validate, freeze; returns self."""
        self.derive()
        self.validate()
        self.freeze()
        return self
