"""TRL's GRPOTrainer on the reasoning quickstart task, side by side with vlrl.

    bash benchmarks/trl_env.sh    # once: benchmarks/.trl-venv with TRL (vlrl does not depend on TRL)
    benchmarks/.trl-venv/bin/python benchmarks/bench_trl_reasoning.py --model M --data D --steps N \\
        --out OUT [--vlrl-metrics RUN/metrics.jsonl]

M: a Hugging Face model folder with its processor (the quickstart's tiny Qwen2.5-VL); D: a folder with
train.jsonl and the images it names. The settings are read from vlrl's config (`--config`, by default
examples/reasoning_quickstart.yaml) and mapped onto GRPOConfig in `trl_config`; one "step" here is
one vlrl step: one generation batch (16 prompts x 8 samples) and the optimizer steps taken on it.
Per step, OUT/trl_metrics.jsonl gets the wall seconds, mean reward, accuracy, format score and
completion length. The closing table gives, for TRL and (with `--vlrl-metrics`) vlrl: seconds per
step (mean after the first step), the step and seconds at which the 10-step running mean of
accuracy first reaches 0.8, and the mean accuracy of the last 10 steps.

This venv does not install vlrl: the prompt template is rendered here, and the reward file is loaded
by path (it imports `vlrl.rewards.math_grading`, which needs only the standard library and
math_verify, so the repository root goes on sys.path for it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 10  # steps in the running mean of accuracy
TARGET = 0.8  # running-mean accuracy that counts as "learned"
MARKERS = re.compile(r"(<image>|<video>)")

ScoreFn = Callable[[list[dict[str, Any]]], list[dict[str, float]]]


@dataclass(frozen=True)
class Settings:
    """What the benchmark takes from a vlrl config (defaults: vlrl's own)."""

    prompt_key: str
    answer_key: str
    image_key: str
    format_prompt: Path
    max_response_length: int
    prompts_per_step: int  # data.rollout_batch_size
    prompts_per_update: int  # worker.actor.global_batch_size
    micro_batch: int  # worker.actor.micro_batch_size_per_device_for_update (samples)
    n: int
    temperature: float
    lr: float
    weight_decay: float
    max_grad_norm: float
    clip_low: float
    clip_high: float
    seed: int
    reward: str  # path/to/file.py:function
    kl_coef: float  # 0: no KL term
    kl_ratio_weighted: bool  # algorithm.kl_loss_ratio_weighted: TRL's use_bias_correction_kl


def read_settings(path: Path) -> Settings:
    cfg = yaml.safe_load(path.read_text())
    data, algo, worker = cfg["data"], cfg.get("algorithm", {}), cfg["worker"]
    actor, rollout = worker["actor"], worker["rollout"]
    optim = actor.get("optim", {})
    kl_loss = not algo.get("disable_kl", False) and algo.get("use_kl_loss", False)
    if kl_loss and algo.get("kl_penalty") != "low_var_kl":
        sys.exit("TRL's KL term is the k3 estimator: map only algorithm.kl_penalty=low_var_kl onto it")
    if actor.get("loss_avg_mode", "token") != "token":
        sys.exit("this benchmark maps only loss_avg_mode=token onto TRL")
    if algo.get("adv_estimator", "grpo") != "grpo" or actor.get("ppo_epochs", 1) != 1:
        sys.exit("this benchmark maps only adv_estimator=grpo with ppo_epochs=1 onto TRL")
    return Settings(
        prompt_key=data.get("prompt_key", "prompt"),
        answer_key=data.get("answer_key", "answer"),
        image_key=data.get("image_key", "images"),
        format_prompt=ROOT / data["format_prompt"],
        max_response_length=data["max_response_length"],
        prompts_per_step=data["rollout_batch_size"],
        prompts_per_update=actor["global_batch_size"],
        micro_batch=actor["micro_batch_size_per_device_for_update"],
        n=rollout["n"],
        temperature=rollout.get("temperature", 1.0),
        lr=optim.get("lr", 1e-6),
        weight_decay=optim.get("weight_decay", 1e-2),
        max_grad_norm=actor.get("max_grad_norm", 1.0),
        clip_low=actor.get("clip_ratio_low", 0.2),
        clip_high=actor.get("clip_ratio_high", 0.3),
        seed=data.get("seed", 1),
        reward=worker["reward"]["reward_function"],
        kl_coef=algo.get("kl_coef", 1e-3) if kl_loss else 0.0,
        kl_ratio_weighted=bool(algo.get("kl_loss_ratio_weighted", False)),
    )


def user_turn(text: str) -> list[dict[str, Any]]:
    """One user message whose parts follow the text: an image part at each `<image>`, text between."""
    parts: list[dict[str, Any]] = []
    for piece in MARKERS.split(text):
        if piece == "<video>":
            raise ValueError("video prompts are not supported here")
        if piece == "<image>":
            parts.append({"type": "image"})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return [{"role": "user", "content": parts}]


def load_prompts(data_dir: Path, s: Settings) -> list[dict[str, Any]]:
    """train.jsonl as TRL rows: conversational prompt, its images (PIL) and the answer."""
    from PIL import Image

    env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined)
    template = env.from_string(s.format_prompt.read_text(encoding="utf-8"))
    rows = []
    for line in (data_dir / "train.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        images = [Image.open(data_dir / p).convert("RGB") for p in row.get(s.image_key) or []]
        text = template.render(content=row[s.prompt_key])
        rows.append({"prompt": user_turn(text), "images": images, "answer": str(row[s.answer_key])})
    return rows


def load_score_fn(spec: str) -> ScoreFn:
    file, _, name = spec.partition(":")
    sys.path.insert(0, str(ROOT))  # for `vlrl.rewards.math_grading` (stdlib + math_verify only)
    module_spec = importlib.util.spec_from_file_location("vlrl_reward_file", ROOT / file)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name or "compute_score")


class StepRecorder:
    """TRL reward function plus per-step bookkeeping (a TRL callback through `callback()`).

    TRL scores each generation batch in one call, so the scores of a call belong to the vlrl-style
    step whose last optimizer step ends next."""

    def __init__(self, score_fn: ScoreFn, updates_per_step: int, out_file: Path) -> None:
        self.score_fn, self.updates_per_step, self.out_file = score_fn, updates_per_step, out_file
        self.rows: list[dict[str, float]] = []
        self.scores: dict[str, float] = {}
        self.last = 0.0
        self.trainer_metrics: dict[str, list[float]] = {}  # GRPOTrainer's `_metrics["train"]`, once built
        self.seen: dict[str, int] = {}
        out_file.write_text("")

    def __call__(
        self, completions: list[Any], completion_ids: list[list[int]], answer: list[str], **_: Any
    ) -> list[float]:
        responses = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        scores = self.score_fn(
            [{"response": r, "ground_truth": a} for r, a in zip(responses, answer, strict=True)]
        )
        self.scores = {
            "reward": statistics.fmean(x["overall"] for x in scores),
            "accuracy": statistics.fmean(x["accuracy"] for x in scores),
            "format": statistics.fmean(x["format"] for x in scores),
            "completion_length": statistics.fmean(len(ids) for ids in completion_ids),  # tokens, EOS included
        }
        return [x["overall"] for x in scores]

    def start(self) -> None:
        self.last = time.perf_counter()

    def optimizer_step_done(self, global_step: int) -> None:
        if global_step % self.updates_per_step:
            return
        now = time.perf_counter()
        row = {"step": global_step // self.updates_per_step, "seconds": now - self.last, **self.scores}
        row.update(self.loss_terms())
        self.last = now
        self.rows.append(row)
        with self.out_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
            flush=True,
        )

    def loss_terms(self) -> dict[str, float]:
        """TRL's own per-token KL to the reference and entropy, averaged over this step's micro-batches
        (vlrl logs them as actor/kl_loss and actor/entropy)."""
        out = {}
        for name in ("kl", "entropy"):
            values = self.trainer_metrics.get(name, [])
            new = values[self.seen.get(name, 0) :]
            self.seen[name] = len(values)
            if new:
                out[name] = statistics.fmean(new)
        return out

    def callback(self) -> Any:
        from transformers import TrainerCallback

        recorder = self

        class Hook(TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                recorder.start()

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                recorder.optimizer_step_done(state.global_step)

        return Hook()


def trl_config(s: Settings, steps: int, out: Path) -> Any:
    """GRPOConfig equivalent to the vlrl config, as far as TRL allows.

    Batch sizes. TRL counts `per_device_train_batch_size` in completions (samples), not prompts. vlrl
    generates prompts_per_step x n = 16 x 8 = 128 samples per step and updates on mini-batches of
    global_batch_size x n = 8 x 8 = 64 samples, in micro-batches of 32: 2 optimizer steps per
    generation. In TRL (one process): per_device_train_batch_size = 32 (the micro-batch),
    gradient_accumulation_steps = 64 / 32 = 2 (one optimizer step = 64 samples), and
    steps_per_generation = 128 / 32 = 4 micro-batches per generation, so generation_batch_size =
    32 x 4 = 128 and TRL takes 4 / 2 = 2 optimizer steps on each generation. num_iterations = 1 (vlrl's
    ppo_epochs = 1): each sample is used once. max_steps counts optimizer steps: 2 per vlrl step.

    Loss. vlrl's loss_avg_mode=token divides the summed token losses of an optimizer step's
    mini-batch by that mini-batch's token count. TRL's "dapo" is the token-level equivalent: it
    divides by the active tokens of the whole generation batch times grad_accum / steps_per_generation,
    i.e. the mean tokens per optimizer step of this generation (the exact count per mini-batch in vlrl).
    "bnpo" instead takes a token mean per micro-batch and averages the micro-batches; "grpo" averages
    per-sequence means (vlrl's loss_avg_mode=seq).
    """
    from trl import GRPOConfig

    samples_per_step = s.prompts_per_step * s.n
    samples_per_update = s.prompts_per_update * s.n
    if samples_per_update % s.micro_batch or samples_per_step % samples_per_update:
        sys.exit("the vlrl batch sizes must divide each other")
    return GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=s.micro_batch,
        gradient_accumulation_steps=samples_per_update // s.micro_batch,
        steps_per_generation=samples_per_step // s.micro_batch,
        num_iterations=1,
        max_steps=steps * (samples_per_step // samples_per_update),
        num_generations=s.n,
        max_completion_length=s.max_response_length,
        temperature=s.temperature,
        top_p=1.0,
        top_k=0,  # no top-k (vlrl: top_k=-1)
        learning_rate=s.lr,
        lr_scheduler_type="constant",  # vlrl: constant, no warm-up
        warmup_steps=0,
        weight_decay=s.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=s.max_grad_norm,
        loss_type="dapo",
        epsilon=s.clip_low,
        epsilon_high=s.clip_high,
        beta=s.kl_coef,  # KL loss to the reference (k3, vlrl's low_var_kl); 0: no reference model
        # k3 times the ratio pi / pi_old (TRL's default True since 1.x); vlrl's default is False
        use_bias_correction_kl=s.kl_ratio_weighted,
        scale_rewards="group",  # GRPO: (r - group mean) / group std
        mask_truncated_completions=False,  # vlrl trains on truncated responses (scored 0)
        shuffle_dataset=True,
        seed=s.seed,
        use_vllm=False,  # transformers generate
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def run_trl(args: argparse.Namespace, s: Settings) -> list[dict[str, float]]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import GRPOTrainer

    args.out.mkdir(parents=True, exist_ok=True)
    config = trl_config(s, args.steps, args.out)
    updates_per_step = config.steps_per_generation // config.gradient_accumulation_steps
    recorder = StepRecorder(load_score_fn(s.reward), updates_per_step, args.out / "trl_metrics.jsonl")
    torch.manual_seed(s.seed)
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32)
    # left padding, as TRL loads it itself: it left-pads the prompt ids and expects the processor's
    # mm_token_type_ids padded the same way
    processor = AutoProcessor.from_pretrained(args.model, padding_side="left")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=recorder,
        args=config,
        train_dataset=Dataset.from_list(load_prompts(args.data, s)),
        processing_class=processor,
        callbacks=[recorder.callback()],
    )
    recorder.trainer_metrics = trainer._metrics["train"]  # filled as it trains (no public hook per step)
    trainer.train()
    return recorder.rows


def read_vlrl(path: Path) -> list[dict[str, float]]:
    """vlrl's metrics.jsonl as rows with seconds and accuracy (rows of a step merged, validation-only
    rows skipped)."""
    by_step: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step.setdefault(int(row["step"]), {}).update(row)
    return [
        {"step": step, "seconds": row["timing/step"], "accuracy": row["reward/accuracy"]}
        for step, row in sorted(by_step.items())
        if "timing/step" in row and "reward/accuracy" in row
    ]


def summary(name: str, rows: list[dict[str, float]]) -> list[str]:
    seconds = [r["seconds"] for r in rows]
    accuracy = [r["accuracy"] for r in rows]
    per_step = statistics.fmean(seconds[1:] or seconds) if seconds else float("nan")
    reached_step, reached_seconds = "not reached", "not reached"
    for end in range(WINDOW, len(rows) + 1):
        if statistics.fmean(accuracy[end - WINDOW : end]) >= TARGET:
            reached_step, reached_seconds = str(end), f"{sum(seconds[:end]):.1f}"
            break
    final = statistics.fmean(accuracy[-WINDOW:]) if accuracy else float("nan")
    return [name, str(len(rows)), f"{per_step:.2f}", reached_step, reached_seconds, f"{final:.3f}"]


def print_table(runs: dict[str, list[dict[str, float]]]) -> None:
    header = [
        "run",
        "steps",
        "s/step (after 1st)",
        f"steps to acc{WINDOW}>={TARGET}",
        f"s to acc{WINDOW}>={TARGET}",
        f"final acc{WINDOW}",
    ]
    lines = [header] + [summary(name, rows) for name, rows in runs.items()]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, required=True, help="Hugging Face model folder (with processor)"
    )
    parser.add_argument("--data", type=Path, required=True, help="folder with train.jsonl and its images")
    parser.add_argument("--steps", type=int, required=True, help="vlrl-style steps (generation batches)")
    parser.add_argument("--out", type=Path, required=True, help="output folder (trl_metrics.jsonl)")
    parser.add_argument("--config", type=Path, default=ROOT / "examples/reasoning_quickstart.yaml")
    parser.add_argument("--vlrl-metrics", type=Path, help="vlrl's metrics.jsonl, summarised alongside")
    args = parser.parse_args()
    settings = read_settings(args.config)
    runs = {"trl": run_trl(args, settings)}
    if args.vlrl_metrics:
        runs["vlrl"] = read_vlrl(args.vlrl_metrics)
    print_table(runs)


if __name__ == "__main__":
    main()
