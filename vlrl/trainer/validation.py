"""Validation: the validation prompts generated with `worker.rollout.val_override_config`, scored,
and summed up as `val/*` metrics; with `trainer.val_blind_rows`, the visual-reliance check
(`vlrl.trainer.visual_reliance`) on the first batch's prompts with images.

It knows no ranks: the trainer hands it a function that generates and scores a batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vlrl.batch.rows import PromptBatch
from vlrl.batch.samples import StepSamples
from vlrl.trainer.metrics import mean_reward_parts, multi_turn_metrics
from vlrl.trainer.visual_reliance import BlindCheck, blanked, image_slice, mean_part, score_part, swapped

logger = logging.getLogger(__name__)

# (prompts, sampling overrides, whether the samples must carry their response ids) -> scored samples
GenerateScored = Callable[[PromptBatch, dict[str, Any], bool], StepSamples]


class Validation:
    """`loader`: the validation loader; `blind_rows`: `trainer.val_blind_rows`; `to_log`:
    `trainer.val_generations_to_log`; `decode`: token ids -> text (the logged generations)."""

    def __init__(
        self,
        loader: Any,
        overrides: dict[str, Any],
        blind_rows: int,
        to_log: int,
        decode: Callable[[list[int]], str],
    ) -> None:
        self.loader, self.overrides, self.blind_rows, self.to_log = (
            loader,
            dict(overrides),
            blind_rows,
            to_log,
        )
        self.decode = decode
        self.blind_check = BlindCheck()

    def run(self, generate: GenerateScored, step: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """(the `val/*` metrics, up to `to_log` generations to log) of one validation at `step`."""
        parts: list[dict[str, float]] = []
        uids: list[int] = []
        samples: list[dict[str, Any]] = []
        lengths: list[int] = []
        trajectories: list[dict[str, Any]] = []
        first: PromptBatch | None = None
        start = time.perf_counter()
        for prompts in self.loader:
            first = first or prompts
            batch = generate(prompts, self.overrides, len(samples) < self.to_log)
            parts.extend(batch.scored_parts())
            uids.extend(batch.group_ids.tolist())
            lengths.extend(batch.response_mask.sum(-1).tolist())
            trajectories.extend(batch.trajectories or [])
            if len(samples) < self.to_log:
                samples.extend(self._generation_samples(batch))
        metrics = mean_reward_parts(parts, "val")
        metrics["val/response_length"] = sum(lengths) / max(len(lengths), 1)
        metrics.update(multi_turn_metrics(trajectories, "val_multi_turn"))
        if first is not None and self.blind_rows > 0:
            metrics.update(self._visual_reliance(generate, first, uids, parts, step))
        metrics["timing/validation"] = time.perf_counter() - start
        return metrics, samples[: self.to_log]

    def _visual_reliance(
        self,
        generate: GenerateScored,
        prompts: PromptBatch,
        uids: list[int],
        all_parts: list[dict[str, float]],
        step: int,
    ) -> dict[str, float]:
        """The first validation batch's prompts with images, generated again with blank and with
        swapped images; `all_parts`: the validation's samples' scores, `uids` their prompts."""
        image_rows = image_slice(prompts, self.blind_rows)
        if image_rows is None:
            return {}
        blind, swap = (
            generate(changed, self.overrides, False).scored_parts()
            for changed in (blanked(image_rows), swapped(image_rows))
        )
        in_slice = set(image_rows.uids)
        real = [p for uid, p in zip(uids, all_parts) if uid in in_slice]
        val_score = mean_part(all_parts, score_part(real))
        metrics, warning = self.blind_check.metrics(real, blind, swap, val_score)
        if warning is not None:
            logger.warning("step %d: %s", step, warning)
        return metrics

    def _generation_samples(self, batch: StepSamples) -> list[dict[str, Any]]:
        lengths = batch.turn_lengths.tolist()  # multi-turn: all turns
        assert batch.responses is not None  # asked for while generations are logged
        return [
            {"prompt": prompt, "response": self.decode(row[:n]), "ground_truth": truth,
             "score": parts.get("overall")}
            for prompt, row, n, truth, parts in zip(batch.prompts, batch.responses.tolist(), lengths,
                                                     batch.ground_truths, batch.scored_parts())
        ]  # fmt: skip
