"""GPU-only checks of issue 14's fixes (skipped without CUDA; CI never runs them).

- attention: the varlen kernels (bf16, GQA, causal text / bidirectional vision) against
  per-sequence sdpa, forward and gradients;
- FSDP CPU offload on a `cuda:nccl,cpu:gloo` group (torch 2.13 distributed_c10d.BackendConfig:
  plain "nccl" maps only cuda, so CPU-tensor collectives had no backend);
- actor offload around generation frees GPU memory; resume keeps bf16 moments on CPU
  (torch 2.13 optim/optimizer.py `_process_value_according_to_param_policy` casts states to
  their parameter's dtype/device on load).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(900),
]


def _per_sequence(q, k, v, lengths, causal):
    """[1, H, T, D] reference: sdpa per sequence with repeated kv heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=causal))
        start += n
    return torch.cat(outs, 2).transpose(1, 2)


@pytest.mark.parametrize(("causal", "dim"), [(True, 64), (False, 64), (False, 80), (False, 72)])
def test_varlen_kernel_matches_per_sequence_sdpa_bf16_gqa(causal, dim):
    """Text (causal, GQA) and vision (bidirectional; head dims 80 for Qwen2/2.5-VL, 72 for Qwen3-VL)."""
    from vlrl.models import attention

    backend = attention._resolve_backend("auto", torch.device("cuda"), torch.bfloat16)
    if backend == "loop":
        pytest.skip("no varlen kernel in this torch / without flash-attn")
    torch.manual_seed(0)
    lengths = [1, 7, 300, 2048, 33]
    shape = (1, 8, sum(lengths), dim)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, sum(lengths), dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    info = attention.make_varlen_info(lengths, "cuda")
    if causal:
        out = attention.varlen_attention_forward(torch.nn.Module(), q, k, v, None, vlrl_varlen=info)[0]
    else:
        out = attention.vision_varlen_attention_forward(
            torch.nn.Module(), q, k, v, None, cu_seq_lens_q=info.cu_seqlens, max_length_q=max(lengths)
        )[0]
    ref = _per_sequence(q.float(), k.float(), v.float(), lengths, causal)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)


def test_fp32_never_reaches_a_flash_kernel():
    from vlrl.models import attention

    assert attention._resolve_backend("auto", torch.device("cuda"), torch.float32) == "loop"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.dirname(__file__))
    import gpu_fixes_job

    from vlrl.models.tiny import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path_factory.mktemp("gpu_model"), arch="qwen2_5_vl"))
    out = tmp_path_factory.mktemp("gpu_job")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(gpu_fixes_job.run, args=(1, port, model_dir, str(out)), nprocs=1, start_method="spawn")
    return torch.load(Path(out) / "results.pt", weights_only=False)


def test_fsdp_cpu_offload_trains_and_gathers(job):
    assert job["cpu_offload/param_devices"] == {"cpu"} and job["cpu_offload/optim_devices"] == {"cpu"}
    assert job["cpu_offload/manual"] == (False, False)
    assert job["cpu_offload/moved"] > 0 and job["cpu_offload/grad_norm"] > 0


def test_offload_frees_gpu_memory_and_comes_back(job):
    assert job["offload/optim_after_update"] == {"cpu"}
    assert job["offload/params_offloaded"] == {"cpu"} and job["offload/freed_bytes"] > 0
    assert job["offload/params_back"] == {"cuda"}


def test_resume_keeps_bf16_states_on_cpu(job):
    assert job["resume/loaded"] == job["resume/saved"]
    assert {d for _, d in job["resume/saved"]} == {"cpu"}
    assert {t for t, _ in job["resume/saved"]} == {torch.bfloat16}
