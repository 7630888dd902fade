"""Metric loggers selected by `trainer.logger`: console, file (JSONL), wandb, tensorboard."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

CONSOLE_KEYS = (
    "reward/overall", "val/overall", "response_length/mean", "actor/pg_loss", "actor/kl_loss",
    "actor/grad_norm", "actor/ppo_kl", "timing/step", "perf/tokens_per_s",
)  # fmt: skip


class ConsoleLogger:
    """One compact line per step with the keys people watch."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        shown = [f"{key.split('/', 1)[-1] if key.startswith('actor') else key}={metrics[key]:.4g}"
                 for key in CONSOLE_KEYS if key in metrics]  # fmt: skip
        print(f"[step {step}] " + "  ".join(shown), file=sys.stderr, flush=True)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        for sample in samples[:2]:
            print(f"[step {step}] sample: {json.dumps(sample, ensure_ascii=False)[:300]}", file=sys.stderr)

    def close(self) -> None:
        pass


class FileLogger:
    """`metrics.jsonl` (one object per step) and `generations.jsonl` in the run's folder."""

    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        self.metrics_file = open(os.path.join(folder, "metrics.jsonl"), "a")  # noqa: SIM115 (kept open)
        self.generations_file = open(os.path.join(folder, "generations.jsonl"), "a")  # noqa: SIM115

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics_file.flush()

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        for sample in samples:
            self.generations_file.write(
                json.dumps({"step": step, **sample}, ensure_ascii=False, default=str) + "\n"
            )
        self.generations_file.flush()

    def close(self) -> None:
        self.metrics_file.close()
        self.generations_file.close()


class WandbLogger:
    """Weights & Biases; set WANDB_MODE=offline where there is no network."""

    def __init__(self, project: str, name: str, config: dict[str, Any], folder: str) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, config=config, dir=folder)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        if samples:
            columns = list(samples[0])
            table = self.wandb.Table(
                columns=columns, data=[[str(s.get(c)) for c in columns] for s in samples]
            )
            self.run.log({"val/generations": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorboardLogger:
    def __init__(self, folder: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(folder, "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        text = "\n\n".join(json.dumps(s, ensure_ascii=False, default=str) for s in samples)
        self.writer.add_text("val/generations", text, step)

    def close(self) -> None:
        self.writer.close()


class Tracker:
    """Fans every call out to the configured loggers."""

    def __init__(
        self, names: list[str], project: str, experiment: str, folder: str, config: dict[str, Any]
    ) -> None:
        self.loggers: list[Any] = []
        for name in names:
            if name == "console":
                self.loggers.append(ConsoleLogger())
            elif name == "file":
                self.loggers.append(FileLogger(folder))
            elif name == "wandb":
                self.loggers.append(WandbLogger(project, experiment, config, folder))
            elif name == "tensorboard":
                self.loggers.append(TensorboardLogger(folder))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        for logger in self.loggers:
            logger.log_generations(samples, step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
