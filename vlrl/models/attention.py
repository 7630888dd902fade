"""Block-diagonal causal attention for packed ("padding-free") sequences.

transformers' sdpa/eager implementations treat a packed row [1, total] as ONE sequence: tokens of
the second sample attend to the first. So we register our own attention function under
`VARLEN_ATTENTION` with `transformers.AttentionInterface` and tell it where each sequence starts
through an extra forward kwarg, `vlrl_varlen=VarlenInfo(...)`. transformers passes unknown forward
kwargs down to every attention call (decoder layers and, harmlessly, the vision blocks, whose own
implementation ignores them), also through gradient checkpointing, so no global state is needed.

Only the text decoder uses this function: `set_text_attention` switches the text sub-config.
The vision tower gets `vision_varlen_attention_forward` (`set_vision_attention`): bidirectional
attention within each window/image, one varlen kernel call per block on GPU.

Backends ("auto" picks the first that applies):
- "flash": `flash_attn_varlen_func` (CUDA, fp16/bf16, when flash-attn imports; probed once);
- "torch_varlen": `torch.nn.attention.varlen.varlen_attn` (CUDA, fp16/bf16, torch >= 2.9);
- "loop": one causal sdpa call per sequence, cost sum(L_i^2) (default on CPU: see benchmarks);
- "mask": one sdpa call over the whole row with a [T, T] block-diagonal causal mask, cost T^2.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from vlrl.models.ulysses import SequenceParallel, heads_to_seq, repeat_kv_for, seq_to_heads

VARLEN_ATTENTION = "vlrl_varlen"
# "flash" in the name is what makes transformers' vision attention pass the window boundaries
VISION_ATTENTION = "vlrl_flash_varlen_vision"
logger = logging.getLogger(__name__)
BACKENDS = ("auto", "flash", "torch_varlen", "loop", "mask")


@dataclass
class VarlenInfo:
    """Where the sequences of a packed row start. Built once per forward, shared by all layers."""

    cu_seqlens: torch.Tensor  # [S + 1] int32 cumulative lengths, on the compute device
    lengths: list[int]  # the S lengths as Python ints (no device sync inside the layers)
    backend: str = "auto"
    sp: SequenceParallel | None = None  # Ulysses: the layers see 1/sp of the tokens (see ulysses.py)
    max_len: int | None = None  # the longest sequence when known without `lengths` (vision windows)
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def max_seqlen(self) -> int:
        if self.max_len is not None:
            return self.max_len
        return max(self.lengths) if self.lengths else 0

    def block_causal_mask(self) -> torch.Tensor:
        """[T, T] bool, True where query t may attend key s: same sequence and s <= t. Cached."""
        if self._mask is None:
            device = self.cu_seqlens.device
            lengths = torch.tensor(self.lengths, device=device)
            seg = torch.repeat_interleave(torch.arange(len(self.lengths), device=device), lengths)  # [T]
            idx = torch.arange(seg.numel(), device=device)
            self._mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
        return self._mask


def make_varlen_info(
    lengths: list[int], device: torch.device | str, backend: str = "auto", sp: SequenceParallel | None = None
) -> VarlenInfo:
    """A `VarlenInfo` for sequences of `lengths` packed in this order (the whole row, also with sp)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown varlen attention backend {backend!r}; valid: {list(BACKENDS)}")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return VarlenInfo(cu_seqlens=cu.to(device), lengths=list(lengths), backend=backend, sp=sp)


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # the only dtypes the flash kernels take


def _resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel for this call: "auto" picks flash > torch_varlen > loop.

    Both varlen kernels are flash-attention kernels (fp16/bf16 only), so "auto" falls back to
    "loop" for fp32; asking for one of them explicitly with fp32 is an error that says so.
    """
    if backend in ("flash", "torch_varlen") and dtype not in FLASH_DTYPES:
        raise ValueError(
            f"attention backend {backend!r} runs flash-attention kernels, which take fp16/bf16, not "
            f"{dtype}: use 'auto' (falls back to 'loop'), 'loop' or 'mask', or compute in bf16"
        )
    if backend != "auto":
        return backend
    if device.type == "cuda" and dtype in FLASH_DTYPES:
        if _flash_attn_varlen() is not None:
            return "flash"
        if _torch_varlen() is not None:
            return "torch_varlen"
    return "loop"


@functools.cache
def _flash_attn_varlen():
    """flash-attn's varlen function, or None when it cannot be imported. Probed once per process.

    Any exception counts as "not available", not only ImportError: a flash-attn wheel built for
    another torch/CUDA fails at import with OSError/RuntimeError (undefined symbols)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    except Exception as error:  # installed but broken: say so once, then use the next backend
        logger.warning(
            "flash-attn is installed but failed to import (%s: %s); not using it", type(error).__name__, error
        )
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen():
    """`torch.nn.attention.varlen.varlen_attn` (torch >= 2.9), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _keyword_params(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _call_torch_varlen(fn, q3, k3, v3, cu, max_len: int, scale: float | None, causal: bool = True):
    """`varlen_attn` on q3 [T, H, D], k3/v3 [T, Hkv, D], whichever signature `fn` has.

    torch 2.13 (torch/nn/attention/varlen.py): keyword-only `scale`, `window_size` (causal is
    (-1, 0), full (-1, -1)) and `enable_gqa`. torch 2.9 had `is_causal` and neither `scale` nor `enable_gqa`:
    there grouped kv heads are repeated and a non-default scale is folded into the queries.
    """
    params = _keyword_params(fn)
    kwargs: dict[str, Any] = {}
    if k3.shape[1] != q3.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            rep = q3.shape[1] // k3.shape[1]
            k3, v3 = k3.repeat_interleave(rep, dim=1), v3.repeat_interleave(rep, dim=1)
    if "is_causal" in params:
        kwargs["is_causal"] = causal
    else:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    if scale is not None:
        if "scale" in params:
            kwargs["scale"] = scale
        else:  # the kernel uses 1/sqrt(D): q * (scale * sqrt(D)) gives the same scores
            q3 = q3 * (scale * q3.shape[-1] ** 0.5)
    return fn(q3, k3, v3, cu, cu, max_len, max_len, **kwargs)


def _sdpa(q, k, v, *, causal: bool, mask: torch.Tensor | None, scale: float | None, dropout: float):
    """sdpa with grouped-query heads: q [B, H, T, D], k/v [B, Hkv, T, D] -> [B, H, T, D]."""
    if k.shape[1] != q.shape[1]:  # repeat kv heads: older torch lacks enable_gqa on some paths
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scale
    )


def _flash_varlen(
    q, k, v, info: VarlenInfo, scale: float | None, dropout: float, backend: str, causal: bool = True
):
    """q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, H, T, D] with a varlen CUDA kernel."""
    q3, k3, v3 = (x[0].transpose(0, 1) for x in (q, k, v))  # [T, H, D]
    cu, max_len = info.cu_seqlens, info.max_seqlen
    if backend == "flash":
        flash = _flash_attn_varlen()
        if flash is None:
            raise RuntimeError("attention backend 'flash' needs flash-attn, which cannot be imported here")
        out = flash(q3, k3, v3, cu, cu, max_len, max_len, dropout, softmax_scale=scale, causal=causal)
    else:
        fn = _torch_varlen()
        if fn is None:
            raise RuntimeError(
                "attention backend 'torch_varlen' needs torch.nn.attention.varlen (torch >= 2.9)"
            )
        out = _call_torch_varlen(fn, q3, k3, v3, cu, max_len, scale, causal)
    return out.transpose(0, 1).unsqueeze(0)


def _loop(q, k, v, lengths: list[int], scale: float | None, dropout: float, causal: bool):
    """One sdpa call per sequence: q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, H, T, D]."""
    outs, start = [], 0
    for length in lengths:
        sl = slice(start, start + length)
        outs.append(
            _sdpa(
                q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=causal, mask=None, scale=scale, dropout=dropout
            )
        )
        start += length
    return torch.cat(outs, dim=2)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    vlrl_varlen: VarlenInfo | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls per layer. query [1, H, T, D]; returns ([1, T, H, D], None).

    Without `vlrl_varlen` (a padded batch, generation) it is transformers' own sdpa attention, with
    the mask `varlen_mask` had transformers prepare, so a model left on this implementation still
    handles padded batches exactly like "sdpa".
    """
    if vlrl_varlen is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one row, got a batch of {query.shape[0]}")
    sp = vlrl_varlen.sp
    if sp is not None:  # Ulysses: my tokens of all heads -> my heads of all tokens, and back after
        query = seq_to_heads(query, sp)
        key, value = (seq_to_heads(repeat_kv_for(x, sp), sp) for x in (key, value))
    out = _packed_attention(query, key, value, vlrl_varlen, scaling, dropout)
    if sp is not None:
        out = heads_to_seq(out, sp)
    return out.transpose(1, 2).contiguous(), None


def _packed_attention(query, key, value, info: VarlenInfo, scaling: float | None, dropout: float):
    """Causal attention within each packed sequence: q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, H, T, D]."""
    backend = _resolve_backend(info.backend, query.device, query.dtype)
    if backend in ("flash", "torch_varlen"):
        return _flash_varlen(query, key, value, info, scaling, dropout, backend)
    if backend == "mask":
        mask = info.block_causal_mask()
        return _sdpa(query, key, value, causal=False, mask=mask, scale=scaling, dropout=dropout)
    return _loop(query, key, value, info.lengths, scaling, dropout, causal=True)  # each sequence alone


def vision_varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Vision-tower attention over images / windows packed in one row. query [1, H, T, D].

    transformers 5.19's Qwen2/2.5/3-VL vision attention (`Qwen2_5_VLVisionAttention.forward`)
    passes `cu_seq_lens_q` (window or image boundaries, int32) only to implementations whose name
    contains "flash" (`is_flash_attention_requested`); any other implementation gets one call per
    window from a Python loop (~80 windows per 1000x1000 image, for each windowed block). Here
    the windows go to one varlen kernel call on CUDA (fp16/bf16), and to the same per-window loop
    as transformers' sdpa path elsewhere. Returns ([1, T, H, D], None).
    """
    kwargs.pop(VARLEN_ATTENTION, None)  # the text decoder's packing info may be passed down; not ours
    if cu_seq_lens_q is None:
        raise ValueError("vision attention needs cu_seq_lens_q (the window boundaries)")
    backend = _resolve_backend("auto", query.device, query.dtype)
    if backend in ("flash", "torch_varlen"):
        # transformers computes the longest window once per vision forward and passes it to every
        # block as `max_length_q` (5.17-5.19 `Qwen2_5_VLVisionAttention.forward`, via
        # `get_max_seqlen`): using it avoids a GPU->CPU sync per block; lengths are not needed.
        max_len = kwargs.get("max_length_q")
        if max_len is None:
            max_len = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
        info = VarlenInfo(cu_seqlens=cu_seq_lens_q.to(torch.int32), lengths=[], max_len=int(max_len))
        out = _flash_varlen(query, key, value, info, scaling, dropout, backend, causal=False)
    else:  # per-window sdpa calls: the lengths are needed on the host anyway
        lengths = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
        out = _loop(query, key, value, lengths, scaling, dropout, causal=False)
    return out.transpose(1, 2).contiguous(), None


def set_vision_attention(model: torch.nn.Module) -> None:
    """Put the vision tower (if any) on `vision_varlen_attention_forward` (see there for why)."""
    from vlrl.models.families import family_of

    vision = getattr(model.config, "vision_config", None)
    if vision is None or not family_of(model.config).varlen_vision_attention:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(VISION_ATTENTION, vision_varlen_attention_forward)
    vision._attn_implementation = VISION_ATTENTION


def varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """Mask builder transformers calls for our implementation (once per forward, not per layer).

    Packed rows come without a 2-D padding mask: return None (no [T, T] mask is ever built; the
    attention uses `VarlenInfo`). Padded batches get exactly the mask "sdpa" would get.
    """
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_varlen_attention() -> str:
    """Register our attention and mask functions with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, varlen_mask)
    return VARLEN_ATTENTION


def text_config(model: torch.nn.Module):
    """The config object the text decoder's attention layers read (text_config for VLMs)."""
    config = model.config
    return getattr(config, "text_config", None) or config


def set_text_attention(model: torch.nn.Module, name: str) -> None:
    """Switch only the text decoder to attention implementation `name` (vision keeps its own).

    Attention layers look their implementation up in their config at every call, so this takes
    effect immediately, also on an FSDP-wrapped model.
    """
    if name == VARLEN_ATTENTION:
        register_varlen_attention()
    text_config(model)._attn_implementation = name
