"""`_pick` on both deepstack layouts transformers has used (per-item tuples in 5.19, one tensor before)."""

from types import SimpleNamespace

import torch

from vlrl.models.shared_images import _pick, _rows, _select


def _output(per_layer_tuples: bool):
    items = (torch.arange(4.0).view(2, 2), torch.arange(4.0, 10.0).view(3, 2))  # 2 images: 2 and 3 rows
    layer = tuple(item * 10 for item in items)
    deepstack = [layer, layer] if per_layer_tuples else [torch.cat(layer), torch.cat(layer)]
    return SimpleNamespace(pooler_output=items, deepstack_features=deepstack), items


def test_select_picks_items_in_both_layouts() -> None:
    for per_layer_tuples in (True, False):
        output, items = _output(per_layer_tuples)
        picked = _pick(output, _select, [1, 0, 1])  # 3 copies in token order
        expected = torch.cat([items[1], items[0], items[1]]) * 10
        for layer in picked.deepstack_features:
            got = torch.cat(layer) if per_layer_tuples else layer
            assert isinstance(layer, tuple) == per_layer_tuples  # the layout the forward expects
            torch.testing.assert_close(got, expected)
        torch.testing.assert_close(torch.cat(picked.pooler_output), expected / 10)


def test_rows_slice_the_concatenated_features_in_both_layouts() -> None:
    for per_layer_tuples in (True, False):
        output, items = _output(per_layer_tuples)
        picked = _pick(output, _rows, (1, 4))
        layer = picked.deepstack_features[0]
        got = torch.cat(layer) if per_layer_tuples else layer
        torch.testing.assert_close(got, torch.cat(items)[1:4] * 10)
