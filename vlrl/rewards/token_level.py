"""Turn one scalar reward per sequence into a token-level reward tensor."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def scores_to_token_level(overall: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sample's score on its last valid response token; zeros elsewhere.

    `overall` is `[B]`, `response_mask` `[B, T]` (bool or 0/1). The last valid token is the last
    position where the mask is set, so left or right padding both work; a fully masked row is all
    zeros. The result has `overall`'s dtype (float32 when `overall` is not floating point).
    """
    import torch  # here, not at module level: reward worker processes import this package without torch

    if overall.dim() != 1 or response_mask.dim() != 2 or overall.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores_to_token_level: expected overall [B] and response_mask [B, T], "
            f"got {tuple(overall.shape)} and {tuple(response_mask.shape)}"
        )
    mask = response_mask.bool()
    dtype = overall.dtype if overall.is_floating_point() else torch.float32
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1)
    has_token = last >= 0
    values = torch.where(has_token, overall.to(device=mask.device, dtype=dtype), torch.zeros((), dtype=dtype))
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    # A fully masked row writes its (zeroed) value at position 0, which keeps the row all zeros.
    out.scatter_(1, last.clamp(min=0).unsqueeze(1), values.unsqueeze(1))
    return out
