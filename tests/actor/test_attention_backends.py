"""Which packed-attention kernel runs (CUDA choices decided on CPU), and the varlen call shapes."""

from __future__ import annotations

import builtins

import pytest
import torch
import torch.nn.functional as F

from vlrl.models import attention
from vlrl.models.attention import _call_torch_varlen, _resolve_backend

CUDA = torch.device("cuda")


@pytest.fixture
def probes(monkeypatch):
    """Set what the flash-attn / torch varlen probes report."""

    def set_available(flash: bool, torch_varlen: bool) -> None:
        monkeypatch.setattr(
            attention, "_flash_attn_varlen", lambda: (lambda *a, **k: None) if flash else None
        )
        monkeypatch.setattr(
            attention, "_torch_varlen", lambda: (lambda *a, **k: None) if torch_varlen else None
        )

    return set_available


@pytest.mark.parametrize(
    ("flash", "torch_varlen", "dtype", "expected"),
    [
        (True, True, torch.bfloat16, "flash"),
        (False, True, torch.bfloat16, "torch_varlen"),
        (False, True, torch.float16, "torch_varlen"),
        (False, False, torch.bfloat16, "loop"),
        (True, True, torch.float32, "loop"),  # flash kernels take no fp32
    ],
)
def test_auto_on_cuda(probes, flash, torch_varlen, dtype, expected):
    probes(flash, torch_varlen)
    assert _resolve_backend("auto", CUDA, dtype) == expected


def test_auto_on_cpu_is_loop(probes):
    probes(True, True)
    assert _resolve_backend("auto", torch.device("cpu"), torch.bfloat16) == "loop"


@pytest.mark.parametrize("backend", ["flash", "torch_varlen"])
def test_explicit_flash_backend_with_fp32_says_why(probes, backend):
    probes(True, True)
    with pytest.raises(ValueError, match="fp16/bf16"):
        _resolve_backend(backend, CUDA, torch.float32)


def test_broken_flash_attn_falls_back_and_is_probed_once(monkeypatch):
    """An installed flash-attn built for another torch raises OSError (not ImportError) at import."""
    real_import = builtins.__import__
    attempts = []

    def fake_import(name, *args, **kwargs):
        if name == "flash_attn":
            attempts.append(name)
            raise OSError("flash_attn_2_cuda.so: undefined symbol: _ZN3c10...")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    attention._flash_attn_varlen.cache_clear()
    try:
        assert _resolve_backend("auto", CUDA, torch.bfloat16) in ("torch_varlen", "loop")
        assert _resolve_backend("auto", CUDA, torch.bfloat16) in ("torch_varlen", "loop")
        assert attempts == ["flash_attn"]  # cached: one import attempt per process
    finally:
        attention._flash_attn_varlen.cache_clear()


def _reference(q3, k3, v3, lengths, scale):
    """Causal attention per sequence with plain sdpa: [T, H, D] -> [T, H, D]."""
    rep = q3.shape[1] // k3.shape[1]
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        q, k, v = (
            x[sl].transpose(0, 1) for x in (q3, k3.repeat_interleave(rep, 1), v3.repeat_interleave(rep, 1))
        )
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs)


def _lengths(cu):
    return (cu[1:] - cu[:-1]).tolist()


def varlen_attn_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.9's signature: no scale (1/sqrt(D)), no enable_gqa (equal head counts only)."""
    assert is_causal and key.shape[1] == query.shape[1]
    return _reference(query, key, value, _lengths(cu_seq_q), None)


def varlen_attn_2_13(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    """torch 2.13's signature (torch/nn/attention/varlen.py)."""
    assert window_size == (-1, 0)
    assert enable_gqa == (key.shape[1] != query.shape[1])
    return _reference(query, key, value, _lengths(cu_seq_q), scale)


@pytest.mark.parametrize("fn", [varlen_attn_2_9, varlen_attn_2_13])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_torch_varlen_call_matches_sdpa_for_each_signature(fn, scale):
    torch.manual_seed(0)
    q3, k3, v3 = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)  # GQA 4 -> 2
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    out = _call_torch_varlen(fn, q3, k3, v3, cu, 7, scale)
    torch.testing.assert_close(out, _reference(q3, k3, v3, [3, 7], scale))
