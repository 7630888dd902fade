"""The driver's view of the data: tokenizer, processor, train/validation loaders, epochs, resume."""

from __future__ import annotations

from typing import Any

from vlrl.batch.rows import PromptBatch
from vlrl.config import ConfigError, PPOConfig


class TrainingData:
    def __init__(self, config: PPOConfig) -> None:
        from transformers import AutoConfig

        from vlrl.config.checks import check_data_media
        from vlrl.data import create_dataloaders
        from vlrl.models.processor import load_processor

        model = config.worker.actor.model
        self.tokenizer, self.processor = load_processor(
            model.tokenizer_path or model.model_path, config.data.override_chat_template
        )
        hf_config = AutoConfig.from_pretrained(model.model_path, trust_remote_code=model.trust_remote_code)
        self.tool_schemas = _tool_schemas(config.worker.rollout.multi_turn)
        self.train_loader, self.val_loader = create_dataloaders(
            config.data, self.tokenizer, self.processor, hf_config, tools=self.tool_schemas
        )
        self.pad_token_id = self.train_loader.pad_token_id
        loaders = [loader for loader in (self.train_loader, self.val_loader) if loader]
        self.max_images_per_prompt = max(_max_markers(ld.dataset, config.data.prompt_key) for ld in loaders)
        self.max_videos_per_prompt = max(
            _max_markers(ld.dataset, config.data.prompt_key, kind=1) for ld in loaders
        )
        # what the rows hold decides some rules: checked here, before Ray and the ranks start
        errors = check_data_media(config, self.max_videos_per_prompt)
        if errors:
            raise ConfigError("the data does not fit the config:\n  - " + "\n  - ".join(errors))
        self._batches = iter(self.train_loader)

    @property
    def epoch(self) -> int:
        return self.train_loader.epoch

    def next_train_batch(self) -> PromptBatch:
        """The next batch, crossing into the next epoch (reshuffled) when this one ends."""
        try:
            return next(self._batches)
        except StopIteration:
            self._batches = iter(self.train_loader)
            return next(self._batches)

    def state_dict(self) -> dict[str, Any]:
        return self.train_loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_loader.load_state_dict(state)
        self._batches = iter(self.train_loader)


def _tool_schemas(mt: Any) -> list[dict[str, Any]] | None:
    """The tools' schemas, read in a tool worker process (the driver never imports tool files):
    a tool file that fails to load, or a YAML schema that does not fit its function, stops the run
    here, at start-up."""
    if not mt.enable or not (mt.tools or mt.tool_config_path):
        return None
    from vlrl.rollout.multi_turn.tool_config import tool_entries
    from vlrl.rollout.multi_turn.tool_pool import ToolPool

    with ToolPool(tool_entries(mt), mt.interaction, workers=1, max_images=mt.max_tool_images) as pool:
        return pool.schemas


def _max_markers(dataset: Any, prompt_key: str, kind: int = 0) -> int:
    """Most `<image>` (kind 0) or `<video>` (kind 1) markers in one prompt (the data pipeline
    checked they match the images / videos)."""
    from vlrl.data.prompts import count_markers

    most = 0
    for source in dataset.sources:
        if prompt_key in source.dataset.column_names:
            for text in source.dataset[prompt_key]:
                most = max(most, count_markers(str(text))[kind])
    return most
