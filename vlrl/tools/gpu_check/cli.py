"""`python -m vlrl.tools.gpu_check`: the command line, the registry of checks and the suite runner."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlrl.tools.gpu_check.report import (
    CheckResult,
    build_report,
    environment,
    format_table,
    markdown_path,
    run_check,
    write_markdown,
    write_report,
)


@dataclass(frozen=True)
class CheckSpec:
    name: str
    target: str  # "module:function", imported only when the check runs
    limit_s: float  # time limit on the GPU (the full sizes)
    what: str  # one line for --help

    def load(self) -> Callable[[Any, Any], None]:
        import importlib

        module, function = self.target.split(":")
        return getattr(importlib.import_module(module), function)


_PKG = "vlrl.tools.gpu_check"
# Time limits sum to 570 s, so the whole suite ends within 10 minutes on one GPU even when every
# check hangs until its limit (start-up and the report take a few seconds more).
CHECKS = {
    spec.name: spec
    for spec in (
        CheckSpec("attention", f"{_PKG}.attention_check:check_attention", 40,
                  "packed attention backends vs per-sequence SDPA, bf16 GQA, forward + grads, lengths 1..2048"),
        CheckSpec("rank_worker", f"{_PKG}.worker_check:check_rank_worker", 80,
                  "one RankWorker (HF rollout, KL loss, offloads): setup..resume..model-only save, memory per phase"),
        CheckSpec("packed_vs_padded", f"{_PKG}.logprob_check:check_packed_vs_padded", 40,
                  "packed vs padded log-probs and gradients in bf16; fp32 device vs CPU"),
        CheckSpec("moe_packed", f"{_PKG}.logprob_check:check_moe_packed_vs_padded", 30,
                  "packed_vs_padded on the tiny Qwen3-VL-MoE (grouped_mm experts, top-k routing in bf16)"),
        CheckSpec("qwen3b_update", f"{_PKG}.qwen3b_check:check_qwen3b_update", 170,
                  "Qwen2.5-VL-3B-shaped actor: log-probs, reference, update, LoRA load, weight-sync walk; memory"),
        CheckSpec("optimizer", f"{_PKG}.optim_check:check_optimizer", 60,
                  "AdamW vs AdamWBf16 step time and the grad clip on 3B parameter shapes (DTensors)"),
        CheckSpec("lora", f"{_PKG}.lora_check:check_lora", 30,
                  "LoRA actor (bf16 base, fp32 adapters): merged weights vs peft's merge_and_unload"),
        CheckSpec("two_ranks", f"{_PKG}.two_rank_check:check_two_ranks", 60,
                  "2 GPUs (NCCL): FSDP grads over 2 ranks, Ulysses sp=2 vs sp=1, enable_cpu_offload"),
        CheckSpec("vllm_engine", f"{_PKG}.vllm_check:check_vllm_engine", 60,
                  "where vLLM is installed: runner, generate_stream, sleep/sync/wake memory, TP=2 on 2 GPUs"),
    )
}  # fmt: skip
# The "at GPU scale" measurements (issue "At GPU scale"), a run of their own: `--preset scale`. The
# 3B-shaped model folder is written once and shared (Context.shaped_3b_model); 200 + 300 s of
# limits, so the run ends within 10 minutes with start-up and the model's build included.
SCALE_CHECKS = {
    spec.name: spec
    for spec in (
        CheckSpec("logprob_memory", f"{_PKG}.scale_check:check_logprob_memory", 200,
                  "3B shapes, 152k vocab: builds the model; log-prob pass of 16 rows x 8k-token responses, "
                  "peak memory vs full-logits estimate"),
        CheckSpec("update_mfu", f"{_PKG}.scale_check:check_update_mfu", 300,
                  "3B shapes: update MFU with 16k-token micro-batches, checkpointing 'all' then 'every_k:2'; "
                  "peak memory, allocator retries"),
    )
}  # fmt: skip
ALL_CHECKS = {**CHECKS, **SCALE_CHECKS}
PRESETS = {"acceptance": CHECKS, "scale": SCALE_CHECKS}


# import name -> what to install. torchvision: transformers' Qwen-VL video processors require it
# (transformers/video_processing_utils.py, `@requires(backends=("vision", "torchvision"))`) and the
# tiny models' processors include one; peft: the `lora` check.
REQUIRED_PACKAGES = {"torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers",
                     "safetensors": "safetensors", "PIL": "pillow", "jinja2": "jinja2", "numpy": "numpy",
                     "torchvision": "torchvision (the build matching torch)"}  # fmt: skip
CHECK_PACKAGES = {"lora": {"peft": "peft"}}


def missing_packages(specs: list[CheckSpec]) -> list[str]:
    """What to install before `specs` can run (importlib's find_spec: nothing is imported)."""
    import importlib.util

    needed = dict(REQUIRED_PACKAGES)
    for spec in specs:
        needed.update(CHECK_PACKAGES.get(spec.name, {}))
    return [install for name, install in needed.items() if importlib.util.find_spec(name) is None]


def select(only: str | None, registry: dict[str, CheckSpec] = CHECKS) -> list[CheckSpec]:
    """The checks named in `only` ("a,b"; None or "" = all), in registry order; unknown names fail."""
    if not only:
        return list(registry.values())
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise SystemExit(f"unknown check(s) {unknown}; choose from {list(registry)}")
    return [spec for name, spec in registry.items() if name in names]


def run_suite(
    specs: list[CheckSpec],
    ctx: Any,
    limit_scale: float = 1.0,
    log: Callable[[str], None] = print,
    on_result: Callable[[list[CheckResult]], Any] | None = None,
) -> list[CheckResult]:
    """Run `specs` one after another; each is independent (a failure is recorded, the rest run).

    `on_result(results so far)` after each check: main() rewrites the report then, so a process
    that dies later (a CUDA fault, a killed job) still leaves the results it had."""
    results: list[CheckResult] = []
    for spec in specs:
        log(f"[gpu_check] {spec.name} (limit {spec.limit_s * limit_scale:.0f} s): {spec.what}")
        try:
            check = spec.load()
        except Exception as err:  # noqa: BLE001 (an import error is this check's failure only)
            results.append(run_check(spec.name, _raiser(err), ctx, None))
        else:
            results.append(run_check(spec.name, check, ctx, spec.limit_s * limit_scale))
        log(f"[gpu_check] {spec.name}: {results[-1].status} in {results[-1].seconds:.1f} s")
        _release_memory()  # the next check (vLLM, spawned ranks) needs the GPU memory this one cached
        if on_result is not None:
            on_result(results)
    return results


def time_plan(specs: list[CheckSpec], limit_scale: float = 1.0) -> str:
    """The time budget of each part and the total, printed before anything runs."""
    parts = [f"  {s.name:<18} at most {s.limit_s * limit_scale:5.0f} s  {s.what}" for s in specs]
    total = sum(s.limit_s for s in specs) * limit_scale
    return "\n".join(["[gpu_check] time budget (each part stops at its limit):", *parts,
                      f"  {'total':<18} at most {total:5.0f} s (+ start-up and the report)"])  # fmt: skip


def _release_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _raiser(err: Exception) -> Callable[[Any, Any], None]:
    def check(ctx: Any, outcome: Any) -> None:
        raise err

    return check


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    listing = "\n".join(
        f"  {s.name:<18} {s.what} (limit {s.limit_s:.0f} s)"
        + ("" if s.name in CHECKS else " [--preset scale]")
        for s in ALL_CHECKS.values()
    )
    parser = argparse.ArgumentParser(
        prog="python -m vlrl.tools.gpu_check",
        description="GPU acceptance check of vlrl on one GPU (see docs/gpu.md). Needs torch, torchvision,\n"
        "transformers, safetensors, pillow, jinja2, tokenizers, numpy (peft for the lora check); no vLLM,\n"
        "Ray, flash-attn or network.",
        epilog=f"checks:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out",
        default="gpu_check_report.json",
        help="JSON report path (default: %(default)s); the Markdown report goes next to it (.md)",
    )
    parser.add_argument(
        "--only", default=None, help="comma-separated check names of any preset (default: the preset's)"
    )
    parser.add_argument("--preset", default="acceptance", choices=tuple(PRESETS),
                        help="acceptance: the correctness suite (default); scale: update MFU and log-prob memory "
                        "at 3B shapes. Each fits 10 minutes")  # fmt: skip
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                        help="cuda (the real check), cpu (self-test of the suite; implies --small), auto")  # fmt: skip
    parser.add_argument(
        "--small", action="store_true", help="tiny shapes (fast; what the CPU self-test uses)"
    )
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one, removed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--attention-backend",
        default=None,
        help="packed attention backend of the actor/reference in the model checks (vlrl.models.attention."
        "BACKENDS; default: the actor's own, auto). The attention check tests every backend regardless.",
    )
    parser.add_argument("--limit-scale", type=float, default=None,
                        help="multiply every time limit (default 1 on CUDA, 3 on CPU)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the selected checks, write the report, print the table; exit status 1 if a check failed."""
    args = parse_args(argv)
    specs = select(args.only, ALL_CHECKS) if args.only else list(PRESETS[args.preset].values())
    missing = missing_packages(specs)
    if missing:  # found in a second, not after the first check has written a 7.5 GB model
        raise SystemExit(f"gpu_check needs these packages, not installed here: {', '.join(missing)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from vlrl.tools.gpu_check.context import Context

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda but torch.cuda.is_available() is False (use --device cpu for the self-test)"
        )
    small = args.small or args.device == "cpu"
    if args.attention_backend:
        from vlrl.models.attention import BACKENDS
        from vlrl.workers.sharded_model import ShardedModel

        if args.attention_backend not in BACKENDS:
            raise SystemExit(
                f"--attention-backend {args.attention_backend!r}: choose one of {list(BACKENDS)}"
            )
        ShardedModel.attention_backend = args.attention_backend  # read by every Actor / Reference
    scale = args.limit_scale or (1.0 if args.device == "cuda" else 3.0)
    options = {
        "device": args.device,
        "small": small,
        "preset": None if args.only else args.preset,
        "only": [s.name for s in specs],
        "seed": args.seed,
        "limit_scale": scale,
        "attention_backend": args.attention_backend or "auto",
    }
    env = environment()
    start = time.perf_counter()

    def save(results: list[CheckResult]) -> dict[str, Any]:
        options["total_seconds"] = round(time.perf_counter() - start, 1)
        options["complete"] = len(results) == len(specs)
        report = build_report(results, options, env)
        write_report(report, args.out)
        write_markdown(report, markdown_path(args.out))
        return report

    print(time_plan(specs, scale))
    with tempfile.TemporaryDirectory(prefix="vlrl_gpu_check_") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
        ctx = Context(device=device, small=small, workdir=workdir, seed=args.seed)
        results = run_suite(specs, ctx, scale, on_result=save)
    report = save(results)
    print(format_table(report))
    print(f"report written to {args.out} and {markdown_path(args.out)}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
