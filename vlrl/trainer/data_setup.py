"""The driver's view of the data: tokenizer, processor, train/validation loaders, epochs, resume."""

from __future__ import annotations

import os
from typing import Any

import torch

from vlrl.batch.rows import PromptBatch
from vlrl.batch.samples import StepSamples
from vlrl.config import ConfigError, DataConfig, PPOConfig
from vlrl.data.prompt_stats import PromptStats
from vlrl.data.sources import spec_entries


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
        _check_family(hf_config, config)
        self.tool_schemas = _tool_schemas(config.worker.rollout.multi_turn)
        self.train_loader, self.val_loader = create_dataloaders(
            config.data, self.tokenizer, self.processor, hf_config, tools=self.tool_schemas,
            samples_per_prompt=config.worker.rollout.n,
        )  # fmt: skip
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

        stats = self.train_loader.stats
        assert stats is not None  # create_dataloaders gives the training loader its statistics
        self.stats: PromptStats = stats
        self.check_passes = config.data.sampler == "pass_rate"
        self.sources = _SourceMetrics(config.data, self.train_loader.dataset, self.stats)

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

    def record(self, batch: StepSamples, step: int) -> None:
        """Record a generation round's scored groups (every round, before online filtering) in the
        prompts' statistics; its group ids are still the prompts' uids."""
        parts = batch.scored_parts()
        if self.check_passes:
            problem = self.stats.pass_values_in_unit_range(parts)
            if problem is not None:
                raise ValueError(
                    f"data.sampler=pass_rate reads each sample's 'accuracy' reward (else 'overall') as a pass "
                    f"rate, but {problem}: return an 'accuracy' in [0, 1] from the reward function, or use "
                    "data.sampler=shuffle"
                )
        self.stats.record(batch.group_ids.tolist(), parts, step)

    def step_metrics(self, batch: StepSamples) -> dict[str, float]:
        """The prompts' statistics (`prompts/*`) and, with data mixing, each entry's (`source/*`)."""
        return {**self.stats.metrics(), **self.sources.metrics(batch)}

    def state_dict(self) -> dict[str, Any]:
        return self.train_loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_loader.load_state_dict(state)
        self._batches = iter(self.train_loader)


class _SourceMetrics:
    """`source/<entry>/share`, `reward`, `accuracy` (when the reward has it) and `response_length`
    over a step's trained samples, per entry of `data.train_files`, when `data.train_weights` mixes
    them (nothing otherwise)."""

    def __init__(self, data: DataConfig, dataset: Any, stats: PromptStats) -> None:
        self.names = source_names(spec_entries(data.train_files)) if data.train_weights is not None else []
        self.stats = stats
        self.entry_of_row = torch.tensor(dataset.row_entries()) if self.names else torch.zeros(0)

    def metrics(self, batch: StepSamples) -> dict[str, float]:
        if not self.names:
            return {}
        uids = batch.group_ids & ((1 << 40) - 1)  # BatchFiller adds the round above bit 40
        entry = self.entry_of_row[self.stats.indices(uids)]  # [N]
        parts = batch.scored_parts()
        lengths = batch.response_mask.sum(-1).float()  # [N]
        out = {}
        for e, name in enumerate(self.names):
            rows = torch.nonzero(entry == e).flatten().tolist()
            out[f"source/{name}/share"] = len(rows) / max(len(batch), 1)
            if not rows:
                continue
            out[f"source/{name}/reward"] = sum(parts[i]["overall"] for i in rows) / len(rows)
            if all("accuracy" in parts[i] for i in rows):
                out[f"source/{name}/accuracy"] = sum(parts[i]["accuracy"] for i in rows) / len(rows)
            out[f"source/{name}/response_length"] = float(lengths[rows].mean())
        return out


def _check_family(hf_config: Any, config: PPOConfig) -> None:
    """Refuse, before the data loads and the ranks start, a model whose family has no record, has
    not passed every conformance gate, or cannot do what the config asks (`vlrl.models.families`)."""
    from vlrl.models.families import checkpoint_errors, family_errors, family_of

    try:
        family = family_of(hf_config)
        errors = family_errors(family, config) + checkpoint_errors(family, hf_config)
    except ValueError as err:
        errors = [str(err)]
    if errors:
        raise ConfigError("the model does not fit vlrl or the config:\n  - " + "\n  - ".join(errors))


def source_names(entries: list[str]) -> list[str]:
    """A short name per data entry for metric keys: the file or folder name without extension or
    split (`data/easy.jsonl` -> `easy`), with the entry's number when two would share one."""
    stems = [
        os.path.splitext(os.path.basename(e.split("@")[0].rstrip("/")))[0] or f"entry{i}"
        for i, e in enumerate(entries)
    ]
    return [f"{stem}_{i}" if stems.count(stem) > 1 else stem for i, stem in enumerate(stems)]


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
