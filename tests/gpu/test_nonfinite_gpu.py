"""The non-finite guard's check (`any_nonfinite`) on CUDA tensors as FSDP holds them: bf16 and fp32
shards, an empty shard, inf and nan found, large finite values not mistaken for inf."""

import pytest
import torch

from vlrl.workers.optim import any_nonfinite

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_any_nonfinite_on_cuda(dtype: torch.dtype) -> None:
    big = torch.full((1024,), 3e38, device="cuda").to(dtype)  # near the top of both ranges
    shards = [torch.randn(4096, device="cuda", dtype=dtype), big, torch.empty(0, device="cuda", dtype=dtype)]
    assert not any_nonfinite(shards)
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = shards[0].clone()
        broken[17] = bad
        assert any_nonfinite([*shards, broken])
