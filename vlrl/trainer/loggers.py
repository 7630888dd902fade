"""Metric loggers selected by `trainer.logger`: console, file (JSONL), wandb, tensorboard, swanlab, mlflow."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

CONSOLE_KEYS = (
    "reward/overall", "val/overall", "response_length/mean", "actor/pg_loss", "actor/kl_loss",
    "actor/grad_norm", "actor/ppo_kl", "timing/step", "perf/tokens_per_s",
)  # fmt: skip


class ConsoleLogger:
    """One compact line per step with the keys people watch (always on: without "console" in
    trainer.logger only the generation samples are left out)."""

    def __init__(self, samples: bool = True) -> None:
        self.samples = samples

    def log(self, metrics: dict[str, float], step: int) -> None:
        shown = [f"{key.split('/', 1)[-1] if key.startswith('actor') else key}={metrics[key]:.4g}"
                 for key in CONSOLE_KEYS if key in metrics]  # fmt: skip
        print(f"[step {step}] " + "  ".join(shown), file=sys.stderr, flush=True)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        for sample in samples[: 2 if self.samples else 0]:
            short = {**sample, "prompt": _middle_cut(str(sample.get("prompt", "")), 240)}
            print(f"[step {step}] sample: {json.dumps(short, ensure_ascii=False)[:600]}", file=sys.stderr)

    def close(self) -> None:
        pass


def _rows(path: str) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (none when it does not exist); a torn last line (a killed run) is skipped."""
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def _open_for_append(path: str) -> Any:
    """`path` opened to append lines (kept open); a last line torn by a killed run is ended first,
    so that it does not swallow the first line written now."""
    torn = False
    if os.path.isfile(path) and os.path.getsize(path):
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
    file = open(path, "a")  # noqa: SIM115 (kept open)
    if torn:
        file.write("\n")
    return file


def logged_history(folder: str, up_to_step: int) -> list[dict[str, Any]]:
    """Training steps 1..`up_to_step` as logged in `folder`/metrics.jsonl, in step order: what a
    resumed run's summary and plot start from. Rows of one step are merged in file order, so a
    later attempt's values (and a validation row logged apart) win."""
    merged: dict[int, dict[str, Any]] = {}
    for row in _rows(os.path.join(folder, "metrics.jsonl")):
        step = row.get("step")
        if isinstance(step, int) and 1 <= step <= up_to_step:
            merged.setdefault(step, {}).update((k, v) for k, v in row.items() if k != "attempt")
    return [merged[step] for step in sorted(merged)]


def _middle_cut(text: str, keep: int) -> str:
    """`text` with its middle cut out when longer than `keep` characters: a format prompt puts the
    question at the start, the end or in between, so both ends are kept."""
    if len(text) <= keep:
        return text
    return text[: keep // 2] + " [...] " + text[-keep // 2 :]


class FileLogger:
    """`metrics.jsonl` (one object per step) and `generations.jsonl` in the run's folder.

    Each start of a run in the folder is an attempt (1, 2, ... after resumes): every metrics row
    carries its `attempt`, so the steps an interrupted attempt logged past its last checkpoint,
    which the next one logs again, can be told apart (`logged_history` keeps the newest)."""

    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        path = os.path.join(folder, "metrics.jsonl")
        self.attempt = 1 + max((row.get("attempt", 1) for row in _rows(path)), default=0)
        self.metrics_file = _open_for_append(path)
        self.generations_file = _open_for_append(os.path.join(folder, "generations.jsonl"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.metrics_file.write(json.dumps({"step": step, "attempt": self.attempt, **metrics}) + "\n")
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
        try:
            self.run = wandb.init(project=project, name=name, config=config, dir=folder)
        except wandb.errors.UsageError as exc:  # e.g. "No API key configured"
            raise RuntimeError(
                f"trainer.logger includes wandb, which failed to start: {exc}. Log in (`wandb login`), set "
                "WANDB_MODE=offline to keep the run's logs locally (sync them later), or drop wandb from "
                "trainer.logger"
            ) from exc

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
    """TensorBoard event files in `$TENSORBOARD_DIR/<project>/<experiment>` when TENSORBOARD_DIR is
    set (EasyR1's layout), else in the run's folder (`tensorboard/`)."""

    def __init__(self, folder: str, project: str = "", experiment: str = "") -> None:
        from torch.utils.tensorboard import SummaryWriter

        root = os.environ.get("TENSORBOARD_DIR")
        self.folder = os.path.join(root, project, experiment) if root else os.path.join(folder, "tensorboard")
        print(f"[vlrl] tensorboard logs: {self.folder}", file=sys.stderr, flush=True)
        self.writer = SummaryWriter(self.folder)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        text = "\n\n".join(json.dumps(s, ensure_ascii=False, default=str) for s in samples)
        self.writer.add_text("val/generations", text, step)

    def close(self) -> None:
        self.writer.close()


class SwanlabLogger:
    """SwanLab; its mode follows SWANLAB_MODE (online needs `swanlab login`; local/offline write to
    the run's folder)."""

    def __init__(self, project: str, name: str, config: dict[str, Any], folder: str) -> None:
        import swanlab

        self.swanlab = swanlab
        self.run = swanlab.init(
            project=project, name=name, config=config, log_dir=os.path.join(folder, "swanlog")
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        if samples:
            text = "\n\n".join(json.dumps(s, ensure_ascii=False, default=str) for s in samples)
            self.run.log({"val/generations": self.swanlab.Text(text)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    """MLflow tracking: MLFLOW_TRACKING_URI when set, else a file store in the run's folder (`mlruns/`)."""

    def __init__(self, project: str, name: str, config: dict[str, Any], folder: str) -> None:
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # The database store needs the full mlflow package; the file store is enough for one run.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri("file:" + os.path.abspath(os.path.join(folder, "mlruns")))
        mlflow.set_experiment(project)
        self.run = mlflow.start_run(run_name=name)
        mlflow.log_params({k[:250]: str(v)[:6000] for k, v in _flatten(config).items()})

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({_mlflow_key(k): float(v) for k, v in metrics.items()}, step=step)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        if samples:
            self.mlflow.log_text(
                "\n".join(json.dumps(s, ensure_ascii=False, default=str) for s in samples),
                f"generations/step_{step}.jsonl",
            )

    def close(self) -> None:
        self.mlflow.end_run()


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _mlflow_key(key: str) -> str:
    """MLflow accepts letters, digits, `_ - . / ` and spaces in metric names; others become `_`."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


class Tracker:
    """Fans every call out to the configured loggers."""

    def __init__(
        self, names: list[str], project: str, experiment: str, folder: str, config: dict[str, Any]
    ) -> None:
        self.loggers: list[Any] = [] if "console" in names else [ConsoleLogger(samples=False)]
        for name in names:
            if name == "console":
                self.loggers.append(ConsoleLogger())
            elif name == "file":
                self.loggers.append(FileLogger(folder))
            elif name == "wandb":
                self.loggers.append(WandbLogger(project, experiment, config, folder))
            elif name == "tensorboard":
                self.loggers.append(TensorboardLogger(folder, project, experiment))
            elif name == "swanlab":
                self.loggers.append(SwanlabLogger(project, experiment, config, folder))
            elif name == "mlflow":
                self.loggers.append(MlflowLogger(project, experiment, config, folder))
            else:  # vlrl.config.checks rejects unknown names at start-up; never drop one silently
                raise ValueError(f"unknown logger {name!r}")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        for logger in self.loggers:
            logger.log_generations(samples, step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
