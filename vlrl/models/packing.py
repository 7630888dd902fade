"""Model inputs for one micro-batch, padded or packed, and the response log-probs from the logits.

A `RolloutBatch` row is [prompt (left-padded) | response (right-padded)], L = P + R columns.

- Padded mode feeds the rows as they are ([N, L] with the attention mask).
- Packed ("padding-free") mode drops every padding token and concatenates the N sequences into
  one row [1, T], T = sum of real lengths. Position ids are taken from the batch (already correct
  per sample, 1-D or 3-D mrope) so they restart per sequence; `VarlenInfo` tells our attention
  function (vlrl.models.attention) where each sequence starts, which keeps them independent.

Either way only the positions that score response tokens are kept (`logits_to_keep` holds them),
so the lm-head never runs over prompt tokens. The model returns their final hidden states and the
lm head runs on a chunk of them at a time (vlrl.models.lm_head, `score_tokens`): no [M, V] logits.
An optional extra "anchor" sequence (a dummy image or one text token) can be appended: its output
enters the loss times zero, so every rank runs the same FSDP collectives even with no images / no
samples (see vlrl.workers.vision).

With Ulysses sequence parallelism (`sp`, vlrl.models.ulysses) every rank of the group builds the
same packed row, padded to a multiple of sp with a separate sequence of pad tokens, and keeps its
1/sp slice of the tokens: ids, positions, the kept logits, and (through `vlrl_image_rows`) the
image features of its image tokens. Each rank scores its slice; `forward_log_probs` gathers the
log-probs so every rank of the group sees the whole micro-batch's [N, R] (with autograd).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from vlrl.models.attention import make_varlen_info
from vlrl.models.lm_head import check_gathered, output_head, passthrough_head
from vlrl.models.sampling import SamplingDistribution
from vlrl.models.shared_images import IMAGE_INDEX_KWARG, IMAGE_ROWS_KWARG, VIDEO_INDEX_KWARG
from vlrl.models.ulysses import SequenceParallel, gather_tokens, token_bounds

# Scored tokens per chunk of the lm head and the scoring (`score_tokens`). A chunk materializes its
# logits [LOGIT_CHUNK, V] in the model dtype and ~3 fp32 temporaries of that size (the scores z, the
# softmax and its product with z): at V = 152k, 0.6 GB of bf16 logits and 1.2 GB per fp32 copy,
# whatever the number of tokens. Smaller chunks save memory but run more, thinner matmuls.
LOGIT_CHUNK = 2048


@dataclass
class Anchor:
    """An extra sequence appended to a micro-batch; its outputs are multiplied by 0."""

    token_ids: Tensor  # [k] long
    position_ids: Tensor  # [k] or [3, k]
    pixel_values: Tensor | None = None  # [patches, D] for a dummy image, else None
    image_grid_thw: Tensor | None = None  # [1, 3]
    pixel_values_videos: Tensor | None = None  # [patches, D] for a dummy video, else None
    video_grid_thw: Tensor | None = None  # [1, 3]
    # host copies of token_ids / position_ids, made on first use (`_host_anchor`)
    host_ids: Tensor | None = None
    host_positions: Tensor | None = None


@dataclass
class ForwardInputs:
    """Everything one forward needs, plus where its scored logits go in the [N, R] output."""

    model_kwargs: dict[str, Any]  # input_ids, position_ids, logits_to_keep, ... (model-ready)
    rows: Tensor  # [M] sample row of each scored response token
    cols: Tensor  # [M] response column of each scored token
    targets: Tensor  # [M] the response token ids being scored
    num_rows: int  # N
    response_length: int  # R
    has_anchor: bool  # the last kept logit belongs to the anchor sequence
    padded: bool  # logits come back [N(+1), R+1, V] instead of [1, M(+1), V]
    sp: SequenceParallel | None = None  # Ulysses: logits come back for this rank's slice only
    sp_counts: list[int] | None = None  # scored response tokens in each rank's slice (anchor excluded)


def scored_positions(attention_mask: Tensor, prompt_length: int) -> tuple[Tensor, Tensor]:
    """(rows, cols) [M] of response tokens that are real and follow a real token (so have a logit).

    Data-dependent shape (`nonzero`): call it on a host (CPU) mask, as the input builders do; on a
    GPU mask it would wait for every queued kernel."""
    valid = attention_mask.bool()
    scored = valid[:, prompt_length:] & valid[:, prompt_length - 1 : -1]  # [N, R]
    rows, cols = scored.nonzero(as_tuple=True)
    return rows, cols


def _to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """Copy a finished host tensor to `device` without waiting for the device's queue.

    A blocking host-to-GPU copy synchronizes the stream; a non-blocking one from pageable memory is
    staged at once, and the source is never written again here (a fresh index or a batch row)."""
    return t.to(device, non_blocking=True)


def _host_anchor(anchor: Anchor) -> tuple[Tensor, Tensor]:
    """(token_ids [k], position_ids [k] or [3, k]) of `anchor` on the host, copied once per anchor:
    the input builders index on the host and copy the finished row to the device once."""
    if anchor.host_ids is None or anchor.host_positions is None:
        anchor.host_ids, anchor.host_positions = anchor.token_ids.cpu(), anchor.position_ids.cpu()
    return anchor.host_ids, anchor.host_positions


VideoInputs = tuple[Tensor, Tensor, "list[int] | None"]
"""pixel_values_videos [patches, D], video_grid_thw [n_vid, 3], video index (as image_index)."""


def _vision_kwargs(
    pixel_values: Tensor | None,
    grid: Tensor | None,
    anchor: Anchor | None,
    image_index: list[int] | None,
    videos: VideoInputs | None = None,
) -> dict[str, Any]:
    """pixel_values / image_grid_thw (and pixel_values_videos / video_grid_thw) of the micro-batch,
    with the anchor's dummy image (video) last.

    `image_index` (per image in token order: its row in `grid`) when images are shared, see
    vlrl.models.shared_images; the video index likewise."""
    kwargs = _media_kwargs(
        ("pixel_values", "image_grid_thw", IMAGE_INDEX_KWARG),
        None if pixel_values is None or grid is None else (pixel_values, grid, image_index),
        None if anchor is None else (anchor.pixel_values, anchor.image_grid_thw),
    )
    kwargs.update(
        _media_kwargs(
            ("pixel_values_videos", "video_grid_thw", VIDEO_INDEX_KWARG),
            videos,
            None if anchor is None else (anchor.pixel_values_videos, anchor.video_grid_thw),
        )
    )
    return kwargs


def _media_kwargs(
    names: tuple[str, str, str],
    media: tuple[Tensor, Tensor, list[int] | None] | None,
    dummy: tuple[Tensor | None, Tensor | None] | None,
) -> dict[str, Any]:
    """{pixels, grid[, index]} of one modality: the micro-batch's, then the anchor's dummy."""
    pv: list[Tensor] = []
    gr: list[Tensor] = []
    if media is not None:
        pv.append(media[0])
        gr.append(media[1])
    anchored = dummy is not None and dummy[0] is not None and dummy[1] is not None
    if anchored:
        pv.append(dummy[0])  # type: ignore[index,arg-type]
        gr.append(dummy[1])  # type: ignore[index,arg-type]
    if not pv:
        return {}
    kwargs: dict[str, Any] = {names[0]: torch.cat(pv, 0), names[1]: torch.cat(gr, 0)}
    index = media[2] if media is not None else None
    if index is not None:
        extra = [len(media[1])] if anchored else []  # type: ignore[index]  # the dummy comes last
        kwargs[names[2]] = list(index) + extra
    return kwargs


def build_packed_inputs(
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    prompt_length: int,
    *,
    pixel_values: Tensor | None = None,
    image_grid_thw: Tensor | None = None,
    image_index: list[int] | None = None,
    anchor: Anchor | None = None,
    videos: VideoInputs | None = None,
    attention_backend: str = "auto",
    sp: SequenceParallel | None = None,
    pad_token_id: int = 0,
    image_token_id: int | None = None,
    device: torch.device | str | None = None,
) -> ForwardInputs:
    """Pack rows [N, L] into one row [1, T]; position_ids [N, L] or [N, 3, L] -> [1, T] or [3, 1, T].

    The rows are host (CPU) tensors: every index (boolean masks, `nonzero`, lengths, the Ulysses
    split) is built on the host, then the finished tensors go to `device` (None: the rows' device)
    in one non-blocking copy each, so building the inputs never waits for the GPU. Vision inputs
    are passed as they are (already on the device).

    With `sp`: this rank's slice [1, T'/sp] of the row padded to T' with `pad_token_id` (see
    `_sequence_slice`); `image_token_id` says which image features the slice needs."""
    dev = device if device is not None else input_ids.device
    n, length = input_ids.shape
    valid = attention_mask.bool()  # [N, L]
    ids = input_ids[valid]  # [T], row-major: sample after sample
    if position_ids.dim() == 3:
        pos = position_ids.transpose(0, 1)[:, valid]  # [3, T]
    else:
        pos = position_ids[valid]  # [T]
    lengths = [x for x in valid.sum(-1).tolist() if x > 0]
    rows, cols = scored_positions(attention_mask, prompt_length)
    # Index of each real token in the packed row; the logit at (row, P + col - 1) scores (row, P + col).
    packed_index = (valid.flatten().cumsum(0) - 1).view(n, length)
    keep = packed_index[rows, prompt_length + cols - 1]  # [M]
    if anchor is not None:
        anchor_ids, anchor_pos = _host_anchor(anchor)
        start = ids.numel()
        ids = torch.cat([ids, anchor_ids.to(ids)])
        pos = torch.cat([pos, anchor_pos.to(pos)], dim=-1)
        lengths.append(anchor_ids.numel())
        keep = torch.cat([keep, torch.tensor([start + anchor_ids.numel() - 1], dtype=keep.dtype)])
    vision = _vision_kwargs(pixel_values, image_grid_thw, anchor, image_index, videos)
    targets = input_ids[rows, prompt_length + cols]  # [M]
    rows_d, cols_d, targets_d = (_to_device(t, dev) for t in (rows, cols, targets))
    inputs = ForwardInputs(
        {}, rows_d, cols_d, targets_d, n, length - prompt_length, anchor is not None, padded=False
    )
    if sp is not None:
        ids, pos, lengths = _pad_row(ids, pos, lengths, sp.size, pad_token_id)
        # a backstop for direct use: the trainer refuses videos with SP at start-up (check_data_media)
        if "pixel_values_videos" in vision:
            raise ValueError("sequence parallelism (worker.actor.ulysses_size > 1) does not take videos yet")
        if vision:
            vision[IMAGE_ROWS_KWARG] = _image_rows(ids, sp, image_token_id)
        ids, pos, keep, inputs.sp_counts = _sequence_slice(ids, pos, keep, rows.numel(), sp)
        inputs.sp = sp
    varlen = make_varlen_info(lengths, "cpu", attention_backend, sp)  # cu_seqlens [S + 1] on the host
    varlen.cu_seqlens = _to_device(varlen.cu_seqlens, dev)
    inputs.model_kwargs = {
        "input_ids": _to_device(ids, dev).unsqueeze(0),
        "position_ids": _to_device(pos, dev).unsqueeze(-2),  # [1, T] or [3, 1, T]
        "logits_to_keep": _to_device(keep, dev),
        "vlrl_varlen": varlen,
        **vision,
    }
    return inputs


def _pad_row(
    ids: Tensor, pos: Tensor, lengths: list[int], multiple: int, pad_id: int
) -> tuple[Tensor, Tensor, list[int]]:
    """Pad the packed row to a multiple of `multiple` tokens with a sequence of its own (pad tokens
    attend only to each other and are never scored)."""
    pad = -ids.numel() % multiple
    if not pad:
        return ids, pos, lengths
    ids = torch.cat([ids, ids.new_full((pad,), pad_id)])
    pos = torch.cat([pos, pos.new_zeros((*pos.shape[:-1], pad))], dim=-1)
    return ids, pos, [*lengths, pad]


def _sequence_slice(
    ids: Tensor, pos: Tensor, keep: Tensor, num_scored: int, sp: SequenceParallel
) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """This rank's 1/sp of the padded row: (ids [T/sp], pos [..., T/sp], its kept logit positions
    (local), the scored tokens of each rank). The kept positions ascend (real tokens in packed
    order, then the anchor), so each rank's scored tokens are a contiguous run of them."""
    start, end = token_bounds(ids.numel(), sp)
    owner = keep[:num_scored] // (end - start)  # [M] the rank holding each scored position
    counts = torch.bincount(owner, minlength=sp.size).tolist()
    mine = keep[(keep >= start) & (keep < end)] - start
    return ids[start:end], pos[..., start:end], mine, counts


def _image_rows(ids: Tensor, sp: SequenceParallel, image_token_id: int | None) -> tuple[int, int]:
    """[a, b): the image-feature rows of this rank's slice of the padded row `ids`, i.e. the
    positions of its image tokens among all image tokens (features come in token order, the
    anchor's dummy image last, like its token)."""
    if image_token_id is None:
        raise ValueError("sequence parallelism with images needs the model's image_token_id")
    start, end = token_bounds(ids.numel(), sp)
    is_image = ids == image_token_id
    before = int(is_image[:start].sum())
    return before, before + int(is_image[start:end].sum())


def build_padded_inputs(
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    prompt_length: int,
    *,
    pixel_values: Tensor | None = None,
    image_grid_thw: Tensor | None = None,
    image_index: list[int] | None = None,
    anchor: Anchor | None = None,
    videos: VideoInputs | None = None,
    device: torch.device | str | None = None,
) -> ForwardInputs:
    """Rows as they are; the anchor becomes one more row, its tokens at the end (left-padded).

    As in `build_packed_inputs`, the rows are host tensors, indexed on the host, and the finished
    tensors go to `device` (None: the rows' device) once, without waiting for the GPU."""
    dev = device if device is not None else input_ids.device
    n, length = input_ids.shape
    response_length = length - prompt_length
    rows, cols = scored_positions(attention_mask, prompt_length)  # [M] each, the real rows only
    targets = input_ids[rows, prompt_length + cols]  # [M]
    if anchor is not None:
        anchor_ids, anchor_pos = _host_anchor(anchor)
        k = anchor_ids.numel()
        row = torch.zeros(1, length, dtype=input_ids.dtype)
        row[0, length - k :] = anchor_ids
        mask_row = torch.zeros(1, length, dtype=attention_mask.dtype)
        mask_row[0, length - k :] = 1
        pos_row = torch.zeros((1, *position_ids.shape[1:]), dtype=position_ids.dtype)
        pos_row[..., length - k :] = anchor_pos.to(pos_row)
        input_ids = torch.cat([input_ids, row.to(input_ids)])
        attention_mask = torch.cat([attention_mask, mask_row.to(attention_mask)])
        position_ids = torch.cat([position_ids, pos_row.to(position_ids)])
    pos = position_ids.transpose(0, 1) if position_ids.dim() == 3 else position_ids  # [3, N, L] for mrope
    kwargs: dict[str, Any] = {
        "input_ids": _to_device(input_ids, dev),
        "attention_mask": _to_device(attention_mask, dev),
        "position_ids": _to_device(pos, dev),
        "logits_to_keep": response_length + 1,  # positions P-1 .. L-1; the last one is dropped
        **_vision_kwargs(pixel_values, image_grid_thw, anchor, image_index, videos),
    }
    rows_d, cols_d, targets_d = (_to_device(t, dev) for t in (rows, cols, targets))
    return ForwardInputs(
        kwargs, rows_d, cols_d, targets_d, n, response_length, anchor is not None, padded=True
    )


def _score_chunk(
    logits: Tensor, targets: Tensor, sampling: SamplingDistribution, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """log pi(target) [m] and the entropy of pi [m] (or None) for logits [m, V], all fp32."""
    z = sampling.scores(logits)  # [m, V] fp32: the only full-size temporary
    lse = torch.logsumexp(z, dim=-1)  # [m]
    log_probs = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    # H = lse - sum_v p_v z_v  (banned columns: p_v = 0 and z_v finite, so they add exactly 0)
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else None
    return log_probs, entropy


_compiled_score_chunk: Any = None


def chunk_scorer(compiled: bool) -> Any:
    """`_score_chunk`, or its torch.compile'd version (built once; `worker.actor.use_torch_compile`).

    It takes a chunk's logits: the lm head runs eagerly before it (`_chunk_logits`), outside the
    compiled graph, so the compiled function never traces a (sharded, adapted) module."""
    global _compiled_score_chunk
    if not compiled:
        return _score_chunk
    if _compiled_score_chunk is None:
        _compiled_score_chunk = torch.compile(_score_chunk, dynamic=True)
    return _compiled_score_chunk


def _chunk_logits(hidden: Tensor, head: nn.Module | None) -> Tensor:
    """head(hidden) [m, V] in the model dtype; `hidden` as is when it already holds logits."""
    return hidden if head is None else head(hidden)


def _head_and_score(
    hidden: Tensor,
    targets: Tensor,
    head: nn.Module | None,
    sampling: SamplingDistribution,
    with_entropy: bool,
    score: Any,
) -> tuple[Tensor, Tensor | None]:
    """The checkpointed chunk function: lm head, then log-probs [m] (and entropy [m])."""
    return score(_chunk_logits(hidden, head), targets, sampling, with_entropy)


def _head_and_log_probs(
    hidden: Tensor, targets: Tensor, head: nn.Module | None, sampling: SamplingDistribution, score: Any
) -> tuple[Tensor, Tensor]:
    """The checkpointed chunk function without entropy: (log-probs [m], the chunk's logits [m, V]).

    The logits are returned (not saved: they die with the caller's reference) for a no-grad entropy
    taken outside the checkpoint, which the backward's recomputation therefore never repeats."""
    logits = _chunk_logits(hidden, head)
    log_probs, _ = score(logits, targets, sampling, False)
    return log_probs, logits


def _score_rows(
    hidden: Tensor,
    targets: Tensor,
    head: nn.Module | None,
    sampling: SamplingDistribution,
    score: Any,
    with_entropy: bool,
    entropy_grad: bool,
    grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs [m] (and entropy [m]) of one chunk of rows; checkpointed when `grad`."""
    if not grad:
        return score(_chunk_logits(hidden, head), targets, sampling, with_entropy)
    if entropy_grad or not with_entropy:
        args = (hidden, targets, head, sampling, with_entropy, score)
        return checkpoint(_head_and_score, *args, use_reentrant=False)
    args_lp = (hidden, targets, head, sampling, score)
    log_probs, logits = checkpoint(_head_and_log_probs, *args_lp, use_reentrant=False)
    with torch.no_grad():  # a metric: computed once here, never in backward
        _, entropy = score(logits.detach(), targets, sampling, True)
    return log_probs, entropy


def _needs_grad(hidden: Tensor, head: nn.Module | None) -> bool:
    """Whether a backward can reach the hidden states or the head's parameters."""
    if not torch.is_grad_enabled():
        return False
    head_grad = head is not None and any(p.requires_grad for p in head.parameters())
    return hidden.requires_grad or head_grad


def score_tokens(
    hidden: Tensor,
    targets: Tensor,
    sampling: SamplingDistribution,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    compiled: bool = False,
    head: nn.Module | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs [M] (and entropies [M]) of `targets` under `sampling` applied to the logits.

    `hidden`: final hidden states [M, H] and `head` the model's lm head, or logits [M, V] and no
    head. Works in chunks of LOGIT_CHUNK rows. With autograd, the head and the scoring of a chunk
    run in one checkpointed function: only `hidden` (already live) is kept for backward, and the
    chunk's logits and fp32 temporaries are recomputed there, so peak extra memory is one chunk's
    [LOGIT_CHUNK, V] tensors, whatever M is. The entropy carries gradients only with
    `entropy_grad` (an entropy bonus in the loss); without, it is a metric taken without autograd
    in the forward and never recomputed.
    """
    grad = _needs_grad(hidden, head)
    score = chunk_scorer(compiled)
    log_probs, entropies = [], []
    for chunk, tgt in zip(hidden.split(LOGIT_CHUNK), targets.split(LOGIT_CHUNK)):
        lp, ent = _score_rows(chunk, tgt, head, sampling, score, with_entropy, entropy_grad, grad)
        log_probs.append(lp)
        if ent is not None:
            entropies.append(ent if entropy_grad else ent.detach())
    empty = hidden.new_zeros(0, dtype=torch.float32)
    log_prob = torch.cat(log_probs) if log_probs else empty
    entropy = (torch.cat(entropies) if entropies else empty) if with_entropy else None
    return log_prob, entropy


@dataclass
class LogProbOutput:
    log_probs: Tensor  # [N, R] fp32, 0 where no response token is scored
    entropy: Tensor | None  # [N, R] fp32 or None
    anchor: Tensor  # [] zero-valued scalar tied to every output (add it to the loss)


def _model_outputs(model: nn.Module, inputs: ForwardInputs) -> tuple[Tensor, nn.Module | None]:
    """(final hidden states of the kept positions [.., K, H], the lm head), or (logits [.., K, V],
    None) for a model without output embeddings. See vlrl.models.lm_head."""
    head = output_head(model)
    if head is None:
        return model(**inputs.model_kwargs, use_cache=False).logits, None
    with passthrough_head(head) as calls:
        hidden = model(**inputs.model_kwargs, use_cache=False).logits
    if calls[0] != 1:
        raise RuntimeError(
            f"{type(model).__name__}'s forward called its lm head {calls[0]} times instead of once: "
            "its logits cannot be computed per chunk of tokens"
        )
    check_gathered(head)
    return hidden, head


def forward_log_probs(
    model: nn.Module,
    inputs: ForwardInputs,
    sampling: SamplingDistribution = SamplingDistribution(),
    with_entropy: bool = False,
    entropy_grad: bool = False,
    compiled: bool = False,
) -> LogProbOutput:
    """Run `model` on `inputs` and return the response log-probs (and entropy) as [N, R].

    Both are taken on `sampling`, the distribution the engine sampled from (vlrl.models.sampling).
    The entropy carries gradients only with `entropy_grad` (an entropy bonus in the loss). The
    model returns hidden states and its lm head runs per chunk of scored tokens (`score_tokens`).
    """
    out, head = _model_outputs(model, inputs)  # hidden states (logits without a head), last dim H (V)
    sp, counts = inputs.sp, inputs.sp_counts or []
    if inputs.padded:  # [N(+1), R+1, H]: column j scores response column j
        scored = out[inputs.rows, inputs.cols]  # [M, H]
        extra = out[inputs.num_rows :, -1] if inputs.has_anchor else out[:0, 0]
    else:  # [1, M(+1), H]; with sp only this rank's slice of them
        m = inputs.rows.numel() if sp is None else counts[sp.rank]
        scored, extra = out[0, :m], out[0, m:]
    targets = inputs.targets
    if sp is not None:
        first = sum(counts[: sp.rank])
        targets = targets[first : first + m]
        # every rank's whole slice stays in the graph, even one with nothing scored: its backward
        # must run the same collectives (all-to-alls, FSDP) as the other ranks'
        extra = out[0]
    # Zero times the anchor's outputs keeps it in the autograd graph (an empty micro-batch always has
    # an anchor, or an empty slice). Reduced in fp32 inside the kernel (no fp32 copy).
    anchor = 0.0 * extra.sum(dtype=torch.float32)
    if head is not None:
        # The head over at most one of those rows ([<= 1, V]): every rank's head weight gets a
        # gradient (zero when the row is empty) in every backward, whatever was scored, so the
        # ranks' FSDP reduce-scatters match (vlrl.models.lm_head).
        anchor = anchor + 0.0 * head(extra[:1]).sum(dtype=torch.float32)
    log_prob, entropy_flat = score_tokens(
        scored, targets, sampling, with_entropy, entropy_grad, compiled, head
    )
    if sp is not None:  # every rank of the group gets all M, in packed order
        log_prob = gather_tokens(log_prob, counts, sp)
        if entropy_flat is not None:
            entropy_flat = gather_tokens(entropy_flat, counts, sp)
    shape = (inputs.num_rows, inputs.response_length)
    index = (inputs.rows, inputs.cols)
    log_probs = torch.zeros(shape, dtype=torch.float32, device=out.device).index_put(index, log_prob)
    entropy = None
    if entropy_flat is not None:
        entropy = torch.zeros(shape, dtype=torch.float32, device=out.device).index_put(index, entropy_flat)
    return LogProbOutput(log_probs, entropy, anchor)
