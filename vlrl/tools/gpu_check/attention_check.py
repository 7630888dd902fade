"""Check a: our packed attention backends against per-sequence SDPA (forward and gradients).

Inputs are bf16 with grouped-query heads (16 query / 2 KV heads of dim 128: Qwen2.5-VL-3B's
decoder). A row packs sequences of lengths 1..2048. The reference is per-sequence causal SDPA in
float32 on the same bf16 inputs. The vision tower's kernel (bidirectional within each window or
image, 16 heads of dim 80 and 72) is checked the same way against per-window SDPA; a backend passes when its error against that reference is at
most twice the error of per-sequence SDPA run in bf16 (plus a small floor), for the output and
for dq, dk, dv. The time of one warm forward + backward per backend is recorded too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
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
# vision windows (Qwen2.5-VL: 112 px windows = 64 patches; whole images up to 1024+ patches)
VISION_GPU_LENGTHS = [64, 64, 16, 256, 1024, 400]
VISION_CPU_LENGTHS = [4, 16, 9]
VISION_HEADS, VISION_HEAD_DIMS = 16, (80, 72)


def _reference(q, k, v, lengths: list[int], dtype: torch.dtype, causal: bool = True) -> torch.Tensor:
    """Per-sequence SDPA in `dtype`: q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, T, H, D]."""
    rep = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for length in lengths:
        sl = slice(start, start + length)
        qs, ks, vs = (x[:, :, sl].to(dtype) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal))
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


@dataclass
class _Case:
    """One packed row of bf16 inputs with its fp32 and bf16 per-sequence SDPA references."""

    q: torch.Tensor  # [1, H, T, D]
    k: torch.Tensor  # [1, Hkv, T, D]
    v: torch.Tensor
    grad_out: torch.Tensor  # [1, T, H, D]
    exact: tuple[torch.Tensor, list[torch.Tensor]]  # fp32 SDPA: output, (dq, dk, dv)
    baseline: list[float]  # bf16 SDPA's errors against `exact`: out, dq, dk, dv


def _case(ctx: Context, lengths: list[int], heads: tuple[int, int, int], causal: bool) -> _Case:
    n_heads, kv_heads, dim = heads
    total, dev = sum(lengths), ctx.device
    gen = torch.Generator(device="cpu").manual_seed(ctx.seed)
    q = torch.randn(1, n_heads, total, dim, generator=gen).to(dev, torch.bfloat16)
    k = torch.randn(1, kv_heads, total, dim, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(1, kv_heads, total, dim, generator=gen).to(dev, torch.bfloat16)
    grad_out = torch.randn(1, total, n_heads, dim, generator=gen).to(dev)
    exact = _run(lambda a, b, c: _reference(a, b, c, lengths, torch.float32, causal), q, k, v, grad_out)
    bf16 = _run(lambda a, b, c: _reference(a, b, c, lengths, torch.bfloat16, causal), q, k, v, grad_out)
    baseline = [_err(bf16[0], exact[0])] + [_err(a, b) for a, b in zip(bf16[1], exact[1])]
    return _Case(q, k, v, grad_out, (exact[0], exact[1]), baseline)


def _compare(ctx: Context, outcome: Outcome, label: str, packed, case: _Case) -> dict[str, Any] | None:
    """Run `packed(q, k, v)` twice (the second timed) and expect it within the bf16 SDPA bound."""
    result: dict[str, Any] = {}
    try:
        out, grads, out_dtype = _run(packed, case.q, case.k, case.v, case.grad_out)
    except Exception as err:  # noqa: BLE001 (one broken backend must not hide the others)
        result["error"] = f"{type(err).__name__}: {err}"
        outcome.failures.append(f"{label}: raised {result['error'][:200]}")
        outcome.details[label] = result
        return None
    sync(ctx.device)
    start = time.perf_counter()
    _run(packed, case.q, case.k, case.v, case.grad_out)  # timed second call: forward + backward, warm
    sync(ctx.device)
    result["fwd_bwd_ms"] = round(1000 * (time.perf_counter() - start), 2)
    errors = [_err(out, case.exact[0])] + [_err(a, b) for a, b in zip(grads, case.exact[1])]
    result.update(error_out_dq_dk_dv=errors, dtype_out=str(out_dtype))
    outcome.expect(out_dtype == torch.bfloat16, f"{label}: output dtype {out_dtype}, expected bfloat16")
    for name, got, base in zip(("out", "dq", "dk", "dv"), errors, case.baseline):
        bound = TOLERANCE_FACTOR * base + FLOOR
        outcome.expect(got <= bound, f"{label}: {name} error {got:.3g} > {bound:.3g} (bf16 sdpa: {base:.3g})")
    outcome.details[label] = result
    outcome.summary[f"{label}_max_err"] = max(errors)
    outcome.summary[f"{label}_ms"] = result["fwd_bwd_ms"]
    return result


def check_attention(ctx: Context, outcome: Outcome) -> None:
    """The text decoder's causal kernels (every backend), then the vision tower's bidirectional one."""
    from vlrl.models.attention import make_varlen_info, varlen_attention_forward

    lengths = CPU_LENGTHS if ctx.small else GPU_LENGTHS
    heads = CPU_HEADS if ctx.small else GPU_HEADS
    case = _case(ctx, lengths, heads, causal=True)
    outcome.details.update(lengths=lengths, heads=heads[0], kv_heads=heads[1], head_dim=heads[2],
                           sdpa_bf16_error={"out_dq_dk_dv": case.baseline})  # fmt: skip
    scale = heads[2] ** -0.5
    for backend in backends_to_test(ctx.device):
        info = make_varlen_info(lengths, ctx.device, backend)

        def packed(qq, kk, vv, info=info):
            return varlen_attention_forward(None, qq, kk, vv, None, scaling=scale, vlrl_varlen=info)[0]

        result = _compare(ctx, outcome, backend, packed, case)
        if result is not None:
            result["resolved"] = _resolved(backend, ctx.device)
    outcome.summary["auto_is"] = _resolved("auto", ctx.device)
    outcome.summary["sdpa_bf16_max_err"] = max(case.baseline)
    _check_vision(ctx, outcome)


def _check_vision(ctx: Context, outcome: Outcome) -> None:
    """`vision_varlen_attention_forward` (what every vision block calls) on windows/images of one row,
    bidirectional, with the vision towers' head dims: 80 (Qwen2/2.5-VL: 1280 / 16 heads) and 72
    (Qwen3-VL: 1152 / 16), given `max_length_q` as transformers passes it."""
    from vlrl.models.attention import make_varlen_info, vision_varlen_attention_forward

    lengths = VISION_CPU_LENGTHS if ctx.small else VISION_GPU_LENGTHS
    for dim in VISION_HEAD_DIMS:
        heads = (VISION_HEADS, VISION_HEADS, dim)
        case = _case(ctx, lengths, heads, causal=False)
        cu = make_varlen_info(lengths, ctx.device).cu_seqlens

        def packed(qq, kk, vv, cu=cu, dim=dim):
            return vision_varlen_attention_forward(
                None, qq, kk, vv, None, scaling=dim**-0.5, cu_seq_lens_q=cu, max_length_q=max(lengths)
            )[0]

        _compare(ctx, outcome, f"vision_d{dim}", packed, case)
