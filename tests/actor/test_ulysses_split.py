"""The token split of Ulysses sequence parallelism, checked in one process (no collectives run):
the ranks' slices put together are the packed row, and the start-up checks name the problem."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vlrl.models.packing import Anchor, build_packed_inputs
from vlrl.models.shared_images import IMAGE_ROWS_KWARG
from vlrl.models.ulysses import SequenceParallel, head_errors

IMAGE = 9


def _slices(sp_size: int, anchor: Anchor | None = None):
    # 3 rows [N=3, L=8], prompt length 4; row 1 holds 3 image tokens, row 2 one
    ids = torch.tensor(
        [[0, 0, 5, 6, 7, 8, 1, 0], [IMAGE, IMAGE, IMAGE, 6, 7, 7, 7, 7], [0, 3, IMAGE, 6, 2, 0, 0, 0]]
    )
    mask = (ids != 0).long()
    pos = torch.arange(8).expand(3, 3, 8).transpose(0, 1).contiguous()  # [N, 3, L] mrope
    full = build_packed_inputs(ids, mask, pos, 4, anchor=anchor)
    kwargs = {"pixel_values": torch.zeros(1, 4), "image_grid_thw": torch.ones(1, 3, dtype=torch.long)}
    parts = [
        build_packed_inputs(ids, mask, pos, 4, anchor=anchor, sp=SequenceParallel(None, sp_size, r),
                            pad_token_id=0, image_token_id=IMAGE, **kwargs)
        for r in range(sp_size)
    ]  # fmt: skip
    return full, parts


def test_slices_make_up_the_packed_row():
    anchor = Anchor(torch.tensor([4]), torch.zeros(3, 1, dtype=torch.long))
    for sp_size in (2, 3, 4):
        full, parts = _slices(sp_size, anchor)
        total = full.model_kwargs["input_ids"].numel()  # 5 + 8 + 4 real tokens + the anchor
        padded = total + (-total % sp_size)
        ids = torch.cat([p.model_kwargs["input_ids"][0] for p in parts])
        assert ids.numel() == padded and torch.equal(ids[:total], full.model_kwargs["input_ids"][0])
        assert (ids[total:] == 0).all()  # pad tokens
        pos = torch.cat([p.model_kwargs["position_ids"] for p in parts], dim=-1)
        assert torch.equal(pos[..., :total], full.model_kwargs["position_ids"])
        # the pad tokens are a sequence of their own; every rank sees the whole row's lengths
        assert all(p.model_kwargs["vlrl_varlen"].lengths == [5, 8, 4, 1, *([padded - total] if padded > total else [])]
                   for p in parts)  # fmt: skip
        local = padded // sp_size
        keep = torch.cat([p.model_kwargs["logits_to_keep"] + r * local for r, p in enumerate(parts)])
        assert torch.equal(keep, full.model_kwargs["logits_to_keep"])  # scored positions, anchor last
        assert sum(parts[0].sp_counts) == full.rows.numel()  # the anchor is not a scored token
        rows = [p.model_kwargs[IMAGE_ROWS_KWARG] for p in parts]
        assert rows[0][0] == 0 and rows[-1][1] == 4 and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
        for r, p in enumerate(parts):  # each rank's feature rows are its image tokens
            assert rows[r][1] - rows[r][0] == int((p.model_kwargs["input_ids"] == IMAGE).sum())


def test_head_checks():
    config = SimpleNamespace(text_config=SimpleNamespace(num_attention_heads=12, num_key_value_heads=2))
    assert head_errors(config, 2) == [] and head_errors(config, 4) == []  # kv heads repeated for 4
    assert head_errors(config, 3) == [
        "the model's 2 key/value heads must be divisible by worker.actor.ulysses_size=3 (or divide it: "
        "then they are repeated)"
    ]
    assert "12 attention heads are not divisible by worker.actor.ulysses_size=8" in head_errors(config, 8)[0]


def test_text_model_positions_split_too():
    ids = torch.tensor([[0, 5, 6, 7, 8], [3, 4, 6, 2, 0]])
    mask = (ids != 0).long()
    pos = torch.tensor([[0, 0, 1, 2, 3], [0, 1, 2, 3, 0]])  # 1-D positions (a text-only model)
    parts = [build_packed_inputs(ids, mask, pos, 2, sp=SequenceParallel(None, 3, r)) for r in range(3)]
    got = torch.cat([p.model_kwargs["position_ids"] for p in parts], dim=-1)
    assert got.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0]]  # 8 real tokens, one pad token
    assert all(IMAGE_ROWS_KWARG not in p.model_kwargs for p in parts)
