"""Check a: our packed attention backends against per-sequence SDPA (forward and gradients).

Inputs are bf16 with grouped-query heads (16 query / 2 KV heads of dim 128: Qwen2.5-VL-3B's
decoder). A row packs sequences of lengths 1..2048. The reference is per-sequence causal SDPA in
float32 on the same bf16 inputs; a backend passes when its error against that reference is at
most twice the error of per-sequence SDPA run in bf16 (plus a small floor), for the output and
for dq, dk, dv. The time of one warm forward + backward per backend is recorded too.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from vlrl.tools.gpu_check.context import Context, sync
from vlrl.tools.gpu_check.report import Outcome

GPU_LENGTHS = [1, 2, 17, 128, 333, 1000, 2048]
CPU_LENGTHS = [1, 2, 5, 33, 64]
GPU_HEADS = (16, 2, 128)  # query heads, KV heads, head dim (Qwen2.5-VL-3B text decoder)
CPU_HEADS = (4, 2, 32)
TOLERANCE_FACTOR, FLOOR = 2.0, 2e-3


def _reference(q, k, v, lengths: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Per-sequence causal SDPA in `dtype`: q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, T, H, D]."""
    rep = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for length in lengths:
        sl = slice(start, start + length)
        qs, ks, vs = (x[:, :, sl].to(dtype) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
        start += length
    return torch.cat(outs, dim=2).transpose(1, 2)


def _run(fn, q, k, v, grad_out) -> tuple[torch.Tensor, list[torch.Tensor], torch.dtype]:
    """Output (fp32 copy), (dq, dk, dv) and the output's own dtype of `fn(q, k, v)` for `grad_out`."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach().float(), [x.grad.float() for x in leaves], out.dtype


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def backends_to_test(device: torch.device) -> list[str]:
    """Every backend that can run on `device` ("auto" included: it is what training uses)."""
    import importlib.util

    from vlrl.models.attention import BACKENDS

    names = []
    for name in BACKENDS:
        if name in ("flash", "torch_varlen") and device.type != "cuda":
            continue
        if name == "flash" and importlib.util.find_spec("flash_attn") is None:
            continue
        names.append(name)
    return names


def _resolved(backend: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """What "auto" picks for this device and dtype (the check runs its kernels in bf16)."""
    from vlrl.models.attention import _resolve_backend

    return _resolve_backend(backend, device, dtype) if backend == "auto" else backend


def check_attention(ctx: Context, outcome: Outcome) -> None:
    from vlrl.models.attention import make_varlen_info, varlen_attention_forward

    lengths = CPU_LENGTHS if ctx.small else GPU_LENGTHS
    heads, kv_heads, dim = CPU_HEADS if ctx.small else GPU_HEADS
    total, dev = sum(lengths), ctx.device
    gen = torch.Generator(device="cpu").manual_seed(ctx.seed)
    q = torch.randn(1, heads, total, dim, generator=gen).to(dev, torch.bfloat16)
    k = torch.randn(1, kv_heads, total, dim, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(1, kv_heads, total, dim, generator=gen).to(dev, torch.bfloat16)
    grad_out = torch.randn(1, total, heads, dim, generator=gen).to(dev)
    exact_out, exact_grads, _ = _run(
        lambda *x: _reference(x[0], x[1], x[2], lengths, torch.float32), q, k, v, grad_out
    )
    bf16_out, bf16_grads, _ = _run(
        lambda *x: _reference(x[0], x[1], x[2], lengths, torch.bfloat16), q, k, v, grad_out
    )
    baseline = [_err(bf16_out, exact_out)] + [_err(a, b) for a, b in zip(bf16_grads, exact_grads)]
    outcome.details.update(lengths=lengths, heads=heads, kv_heads=kv_heads, head_dim=dim,
                           sdpa_bf16_error={"out_dq_dk_dv": baseline})  # fmt: skip
    scale = dim**-0.5
    for backend in backends_to_test(dev):
        info = make_varlen_info(lengths, dev, backend)

        def packed(qq, kk, vv, info=info):
            return varlen_attention_forward(None, qq, kk, vv, None, scaling=scale, vlrl_varlen=info)[0]

        case: dict[str, Any] = {"resolved": _resolved(backend, dev)}
        try:
            out, grads, out_dtype = _run(packed, q, k, v, grad_out)
        except Exception as err:  # noqa: BLE001 (one broken backend must not hide the others)
            case["error"] = f"{type(err).__name__}: {err}"
            outcome.failures.append(f"{backend}: raised {case['error'][:200]}")
            outcome.details[backend] = case
            continue
        sync(dev)
        start = time.perf_counter()
        _run(packed, q, k, v, grad_out)  # timed second call: forward + backward, warm
        sync(dev)
        case["fwd_bwd_ms"] = round(1000 * (time.perf_counter() - start), 2)
        errors = [_err(out, exact_out)] + [_err(a, b) for a, b in zip(grads, exact_grads)]
        case["error_out_dq_dk_dv"] = errors
        case["dtype_out"] = str(out_dtype)
        outcome.expect(out_dtype == torch.bfloat16, f"{backend}: output dtype {out_dtype}, expected bfloat16")
        for label, got, base in zip(("out", "dq", "dk", "dv"), errors, baseline):
            bound = TOLERANCE_FACTOR * base + FLOOR
            outcome.expect(
                got <= bound, f"{backend}: {label} error {got:.3g} > {bound:.3g} (bf16 sdpa: {base:.3g})"
            )
        outcome.details[backend] = case
        outcome.summary[f"{backend}_max_err"] = max(errors)
        outcome.summary[f"{backend}_ms"] = case["fwd_bwd_ms"]
    outcome.summary["auto_is"] = _resolved("auto", dev)
    outcome.summary["sdpa_bf16_max_err"] = max(baseline)
