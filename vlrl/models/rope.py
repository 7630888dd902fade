"""Position ids: 1-D for text models, 3-D "mrope" (temporal, height, width) for Qwen2/2.5/3-VL.

Our own implementation of the Qwen-VL rule, version-independent (transformers' `get_rope_index`
changed signature between 4.x and 5.x); tests compare it with transformers 5.19's reference.

The rule, for one unpadded sequence:
- a text token takes position `p` on all three axes, then `p += 1`;
- a vision block (the run of `<|image_pad|>`/`<|video_pad|>` tokens of one image, video or, for
  Qwen3-VL, one video frame) with merged grid (t, h, w) starting at `p` gets
  temporal `p + floor(i_t * interval)`, height `p + i_h`, width `p + i_w`, laid out t-major;
  the next token starts at `max(block positions) + 1`.
- `interval` is 1 for images, Qwen2-VL videos and Qwen3-VL frames (one block per frame, the
  processor writes a timestamp between frames); for Qwen2.5-VL videos it is
  `tokens_per_second * second_per_grid_ts[video]`.

"Next = max + 1" is the original Qwen and vLLM rule. transformers 5.19 instead advances by
`max(h, w)` only, which is the same for images and Qwen3-VL frames but differs for Qwen2/2.5-VL
videos whose temporal extent exceeds their spatial extent. We follow vLLM, which generates the
rollouts, so training and rollout see the same positions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def text_position_ids(length: int) -> torch.Tensor:
    """[L] positions 0..L-1 of one unpadded text sequence."""
    return torch.arange(length, dtype=torch.long)


def _vision_grids(
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: Sequence[float] | torch.Tensor | None,
    tokens_per_second: float,
    family: str,
) -> tuple[Iterator[tuple[int, int, int, float]], Iterator[tuple[int, int, int, float]]]:
    """Per-block (t, h, w, temporal interval) iterators for images and videos (unmerged grids)."""
    images = [
        (int(t), int(h), int(w), 1.0)
        for t, h, w in (image_grid_thw.tolist() if image_grid_thw is not None else [])
    ]
    videos: list[tuple[int, int, int, float]] = []
    for k, (t, h, w) in enumerate(video_grid_thw.tolist() if video_grid_thw is not None else []):
        if family == "qwen3_vl":
            # Qwen3-VL writes a timestamp before every frame: each frame is its own t=1 block.
            videos += [(1, int(h), int(w), 1.0)] * int(t)
        elif family == "qwen2_5_vl":
            seconds = 1.0 if second_per_grid_ts is None else float(second_per_grid_ts[k])
            videos.append((int(t), int(h), int(w), tokens_per_second * seconds))
        else:
            videos.append((int(t), int(h), int(w), 1.0))
    return iter(images), iter(videos)


def _block_positions(start: int, t: int, h: int, w: int, interval: float) -> torch.Tensor:
    """[3, t*h*w] positions of one vision block (merged grid t x h x w) starting at `start`."""
    # float32 like the reference, then truncation toward zero.
    temporal = (torch.arange(t, dtype=torch.float32) * torch.tensor(interval, dtype=torch.float32)).long()
    grid = torch.stack(
        [
            temporal.view(t, 1, 1).expand(t, h, w),
            torch.arange(h).view(1, h, 1).expand(t, h, w),
            torch.arange(w).view(1, 1, w).expand(t, h, w),
        ]
    )
    return grid.reshape(3, -1) + start


def mrope_position_ids(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int,
    tokens_per_second: float = 2.0,
    second_per_grid_ts: Sequence[float] | torch.Tensor | None = None,
    family: str,
) -> torch.Tensor:
    """[3, L] mrope position ids of one unpadded sequence `input_ids` [L] (placeholders expanded).

    `image_grid_thw` [n_img, 3] / `video_grid_thw` [n_vid, 3] are the processor's (unmerged) patch
    grids, in prompt order. Raises ValueError when the placeholder runs do not match the grids.
    """
    if family not in MROPE_FAMILIES:
        raise ValueError(f"unknown mrope family {family!r}; expected one of {MROPE_FAMILIES}")
    ids = input_ids.reshape(-1)
    images, videos = _vision_grids(
        image_grid_thw, video_grid_thw, second_per_grid_ts, tokens_per_second, family
    )
    vision_at = ((ids == image_token_id) | (ids == video_token_id)).nonzero().flatten().tolist()
    chunks: list[torch.Tensor] = []
    cursor, next_pos, k = 0, 0, 0  # k indexes vision_at
    while k < len(vision_at):
        start = vision_at[k]
        chunks.append(torch.arange(start - cursor).expand(3, -1) + next_pos)  # text before the block
        next_pos += start - cursor
        token = int(ids[start])
        is_image = token == image_token_id
        grid = next(images if is_image else videos, None)
        kind = "image" if is_image else "video"
        if grid is None:
            raise ValueError(f"more {kind} placeholder blocks than {kind} grids (block at token {start})")
        if start == 0 or int(ids[start - 1]) != vision_start_token_id:
            raise ValueError(f"{kind} block at token {start} is not preceded by <|vision_start|>")
        t, h, w = grid[0], grid[1] // spatial_merge_size, grid[2] // spatial_merge_size
        n = t * h * w
        if start + n > len(ids) or not bool((ids[start : start + n] == token).all()):
            raise ValueError(
                f"{kind} block at token {start} is shorter than its grid {tuple(grid[:3])} ({n} tokens)"
            )
        block = _block_positions(next_pos, t, h, w, grid[3])
        chunks.append(block)
        next_pos = int(block.max()) + 1
        cursor = start + n
        k += n
    chunks.append(torch.arange(len(ids) - cursor).expand(3, -1) + next_pos)
    for leftover, kind in ((images, "image"), (videos, "video")):
        if next(leftover, None) is not None:
            raise ValueError(f"more {kind} grids than {kind} placeholder blocks in the sequence")
    return torch.cat(chunks, dim=1).long()


def continue_position_ids(
    prompt_position_ids: torch.Tensor, response_length: int, *, mrope: bool | None = None
) -> torch.Tensor:
    """Positions of `response_length` generated tokens after a (left-padded) prompt.

    Input [..., P] ([B, P] text, [B, 3, P] mrope, or an unpadded [P] / [3, P]); output [..., R].
    Every axis continues from (max prompt position over all axes) + 1, the rule of both vLLM and
    transformers after generation. Padding positions must not exceed real ones (ours are 0).
    `mrope` defaults to `ndim == 3`; pass True for a single [3, P] sequence.
    """
    if mrope is None:
        mrope = prompt_position_ids.dim() == 3
    reduce_dims = (-2, -1) if mrope else (-1,)
    start = prompt_position_ids.amax(dim=reduce_dims, keepdim=True) + 1  # [..., 1, 1] or [..., 1]
    steps = torch.arange(response_length, device=prompt_position_ids.device)
    out = start + steps  # broadcasts to [..., 1, R] or [..., R]
    if mrope:
        out = out.expand(*prompt_position_ids.shape[:-1], response_length).contiguous()
    return out.long()


def left_pad_position_ids(position_ids: Sequence[torch.Tensor], length: int | None = None) -> torch.Tensor:
    """Stack per-sequence position ids ([L_i] or [3, L_i]) into [B, P] or [B, 3, P], left-padded with 0.

    P = `length` or the longest sequence. Padding positions are 0 (they are masked out by the
    attention mask; 0 never exceeds a real position, so `continue_position_ids` is unaffected).
    """
    if not position_ids:
        raise ValueError("left_pad_position_ids needs at least one sequence")
    longest = max(p.shape[-1] for p in position_ids)
    length = longest if length is None else length
    if length < longest:
        raise ValueError(f"length {length} is shorter than the longest sequence ({longest})")
    lead = position_ids[0].shape[:-1]  # () or (3,)
    out = torch.zeros(len(position_ids), *lead, length, dtype=torch.long)
    for row, pos in enumerate(position_ids):
        out[row, ..., length - pos.shape[-1] :] = pos
    return out
