"""trainer.device=auto on a machine whose NVIDIA GPUs torch cannot use (issue 31, finding 13):
a start-up error with the driver's story, not a silent CPU run. Detection is monkeypatched."""

import subprocess

import pytest
import torch

from vlrl.config import ConfigError, PPOConfig, resolve_device
from vlrl.utils import gpu_driver
from vlrl.utils.gpu_driver import NvidiaGpus, nvidia_gpus, unusable_gpus_problem

H100S = NvidiaGpus(2, "570.86.15", ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"))


def test_nvidia_smi_rows_are_read() -> None:
    out = "NVIDIA H100 80GB HBM3, 570.86.15\nNVIDIA H100 80GB HBM3, 570.86.15\n"
    assert nvidia_gpus(run=lambda cmd: out) == H100S


def test_no_nvidia_smi_and_no_device_node_is_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(cmd: list[str]) -> str:
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(gpu_driver.os.path, "exists", lambda path: False)
    assert nvidia_gpus(run=missing) is None
    monkeypatch.setattr(gpu_driver.os.path, "exists", lambda path: path == "/dev/nvidia0")
    assert nvidia_gpus(run=missing) == NvidiaGpus(1, None)  # a driver whose nvidia-smi is not on PATH


def test_failing_nvidia_smi_falls_back_to_the_device_node(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(cmd: list[str]) -> str:
        raise subprocess.CalledProcessError(9, cmd)

    monkeypatch.setattr(gpu_driver.os.path, "exists", lambda path: False)
    assert nvidia_gpus(run=fails) is None


def test_the_message_names_driver_requirement_and_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    message = unusable_gpus_problem(cuda_available=lambda: False, find_gpus=lambda: H100S)
    assert message is not None
    for part in ("2 NVIDIA GPU(s) (NVIDIA H100 80GB HBM3)", "driver 570.86.15", "CUDA 13.0",
                 "needs NVIDIA driver >= 580", "trainer.device=cpu"):  # fmt: skip
        assert part in message
    monkeypatch.setattr(torch.version, "cuda", None)
    cpu_build = unusable_gpus_problem(cuda_available=lambda: False, find_gpus=lambda: H100S)
    assert cpu_build is not None and "CPU-only build" in cpu_build


def test_no_problem_when_torch_sees_cuda_or_the_gpus_are_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert unusable_gpus_problem(cuda_available=lambda: True, find_gpus=lambda: H100S) is None
    assert unusable_gpus_problem(cuda_available=lambda: False, find_gpus=lambda: None) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hidden on purpose: CPU is what the user asked for
    assert unusable_gpus_problem(cuda_available=lambda: False, find_gpus=lambda: H100S) is None


def test_auto_fails_instead_of_training_on_cpu() -> None:
    with pytest.raises(ConfigError, match=r"trainer.device=auto: driver too old"):
        resolve_device(None, local_cuda=lambda: False, unusable_gpus=lambda: "driver too old")
    assert resolve_device(None, local_cuda=lambda: False, unusable_gpus=lambda: None) == "cpu"
    assert (
        resolve_device(None, local_cuda=lambda: True, unusable_gpus=lambda: pytest.fail("not asked"))
        == "cuda"
    )


def test_derive_stops_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole path as `load_config` takes it: torch without CUDA, nvidia-smi listing GPUs."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(gpu_driver, "nvidia_gpus", lambda: H100S)
    with pytest.raises(
        ConfigError, match=r"driver 570.86.15, but torch cannot use CUDA.*>= 580.*trainer.device=cpu"
    ):
        PPOConfig().derive()
    config = PPOConfig()
    config.trainer.device = "cpu"  # the way out the message names
    config.derive()
    assert config.trainer.device == "cpu"


def test_a_cuda_rank_stops_with_the_same_story(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_driver, "nvidia_gpus", lambda: H100S)
    with pytest.raises(RuntimeError, match="torch cannot use CUDA"):
        gpu_driver.check_torch_sees_cuda()
