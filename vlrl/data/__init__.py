"""The data pipeline: data files -> validated rows -> prompts with resized images -> `PromptBatch`.

    dataset = RLDataset(config.data.train_files, config.data, tokenizer, processor)
    loader = StatefulPromptLoader(dataset, batch_size=8, seed=config.data.seed)
    for batch in loader: ...            # PromptBatch, left-padded
    state = loader.state_dict()         # exact resume point

See docs/data.md for the dataset format.
"""

from vlrl.data.collate import PromptSample, collate_prompts
from vlrl.data.dataset import RLDataset
from vlrl.data.loader import StatefulPromptLoader, create_dataloaders
from vlrl.data.sources import DataError

__all__ = [
    "DataError",
    "PromptSample",
    "RLDataset",
    "StatefulPromptLoader",
    "collate_prompts",
    "create_dataloaders",
]
