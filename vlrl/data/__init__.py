"""The data pipeline: data files -> validated rows -> prompts with resized images -> `PromptBatch`.

    dataset = RLDataset(config.data.train_files, config.data, tokenizer, processor)
    loader = StatefulPromptLoader(dataset, batch_size=8, seed=config.data.seed)
    for batch in loader: ...            # PromptBatch, left-padded
    state = loader.state_dict()         # exact resume point

See docs/data.md for the dataset format.

The names below are imported on first use: a light submodule (`vlrl.data.synthetic`, which the
shipped shapes rewards read their vocabulary from) loads without torch and transformers, so a
reward worker process that imports it starts in a fraction of a second, not ~3 s with ~650 MB.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlrl.data.collate import PromptSample, collate_prompts
    from vlrl.data.dataset import RLDataset
    from vlrl.data.loader import StatefulPromptLoader, create_dataloaders
    from vlrl.data.sources import DataError

_HOMES = {
    "DataError": "vlrl.data.sources",
    "PromptSample": "vlrl.data.collate",
    "RLDataset": "vlrl.data.dataset",
    "StatefulPromptLoader": "vlrl.data.loader",
    "collate_prompts": "vlrl.data.collate",
    "create_dataloaders": "vlrl.data.loader",
}
__all__ = [
    "DataError",
    "PromptSample",
    "RLDataset",
    "StatefulPromptLoader",
    "collate_prompts",
    "create_dataloaders",
]  # the keys of _HOMES


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
