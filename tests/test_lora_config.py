"""worker.actor.model.lora at start-up: rank > 0 loads, bad values fail naming the key."""

import pytest

from vlrl.config import ConfigError
from vlrl.config.loader import load_config


def test_lora_rank_loads_with_easyr1_defaults(base: list[str]) -> None:
    lora = load_config([*base, "worker.actor.model.lora.rank=8"]).worker.actor.model.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.exclude_modules) == (8, 64, "all-linear", None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["worker.actor.model.lora.rank=-1"], r"lora.rank=-1 must be >= 0"),
        (["worker.actor.model.lora.rank=8", "worker.actor.model.lora.alpha=0"], r"lora.alpha=0 must be > 0"),
        (["worker.actor.model.lora.rank=8", "worker.actor.model.lora.target_modules=' , '"],
         r"lora.target_modules is empty"),
        (["worker.actor.model.lora.rank=8", "worker.actor.model.lora.exclude_modules='(unclosed'"],
         r"lora.exclude_modules='\(unclosed' is not a valid regex"),
    ],
)  # fmt: skip
def test_bad_lora_values_fail_at_start_up(base: list[str], overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config([*base, *overrides])


def test_a_lora_base_is_stored_in_the_compute_dtype_on_gpu_only() -> None:
    """The frozen base needs no fp32 master copy on GPU (half the memory); CPU computes in fp32."""
    import torch

    from vlrl.config import FSDPConfig
    from vlrl.workers.fsdp import frozen_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert frozen_dtype(FSDPConfig(), cuda) == torch.bfloat16
    assert frozen_dtype(FSDPConfig(mp_param_dtype="fp16"), cuda) == torch.float16
    assert frozen_dtype(FSDPConfig(), cpu) == torch.float32
    assert frozen_dtype(FSDPConfig(torch_dtype="fp32"), cuda) == torch.float32  # an explicit choice wins
