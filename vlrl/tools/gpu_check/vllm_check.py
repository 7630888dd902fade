"""Check: the vLLM engine where vLLM is installed (skipped on the bare GPU machine of docs/gpu.md).

One engine (bf16, sleep mode on CUDA) on the tiny Qwen2.5-VL in a one-rank world: the model runner
vLLM picked (V2 by default in 0.32); `generate_stream` reports finished groups and then the batch,
which equals `generate` with the same seed; sleep frees the GPU memory the engine holds, a weight
sync while asleep and the wake give the awake engine's samples again. With two or more GPUs: TP=2
in two processes that each see one GPU (as under Ray), with the all-reduce paths they chose logged,
generating transformers' greedy tokens on both ranks.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from vlrl.tools.gpu_check.context import Context, free_port, single_rank_world
from vlrl.tools.gpu_check.inputs import make_config, prompt_batch
from vlrl.tools.gpu_check.report import Outcome

SEEDED = {"seed": 9}
GREEDY = {"temperature": 0.0, "n": 1}


def _engine(model_dir: str, device: torch.device, tp: int = 1):
    from vlrl.models.processor import load_processor
    from vlrl.rollout import create_rollout_engine

    config = make_config(model_dir, device, **{
        "worker.rollout.dtype": "bf16" if device.type == "cuda" else "fp32",
        "worker.rollout.gpu_memory_utilization": 0.3 if device.type == "cuda" else 0.05,
        "worker.rollout.enable_sleep_mode": device.type == "cuda",
        "worker.rollout.tensor_parallel_size": tp, "worker.rollout.n": 2,
        "worker.rollout.max_num_seqs": 16})  # fmt: skip
    tokenizer, processor = load_processor(model_dir)
    engine = create_rollout_engine(config.worker.rollout, config.data, model_dir, tokenizer, processor)
    return engine, config


def _close(engine) -> None:
    """Close the engine and vLLM's view of the torch world: the world itself is destroyed next
    (`single_rank_world`), and a later engine in this process must not find vLLM's stale groups."""
    from vllm.distributed.parallel_state import destroy_distributed_environment

    engine.close()
    destroy_distributed_environment()


def _free_mib(device: torch.device) -> float | None:
    return torch.cuda.mem_get_info(device)[0] / 2**20 if device.type == "cuda" else None


def check_vllm_engine(ctx: Context, outcome: Outcome) -> None:
    from vlrl.batch.rows import FinishedGroups
    from vlrl.models.loading import load_model
    from vlrl.rollout import sync_weights

    if importlib.util.find_spec("vllm") is None:
        outcome.skipped = "vLLM is not installed here"
        return
    model_dir = ctx.tiny_model("qwen2_5_vl")
    base = load_model(model_dir, dtype=torch.float32)
    with single_rank_world(ctx.device):
        engine, config = _engine(model_dir, ctx.device)
        try:
            prompts = prompt_batch(model_dir, config.data, 4, 56, ctx.seed)
            sync_weights(base, engine, bucket_mb=1)
            outcome.details["v2_runner"] = bool(getattr(engine, "use_v2", False))
            items = list(engine.generate_stream(prompts, SEEDED))
            groups = [i for i in items if isinstance(i, FinishedGroups)]
            streamed = items[-1]
            awake = engine.generate(prompts, SEEDED).responses
            outcome.details["finished_group_reports"] = len(groups)
            outcome.expect(streamed.responses.equal(awake), "generate_stream's batch differs from generate's")
            outcome.expect(sorted(r for g in groups for r in g.prompt_rows) == list(range(len(prompts))),
                           "generate_stream did not report every group once")  # fmt: skip
            free_awake = _free_mib(ctx.device)
            engine.sleep()
            free_asleep = _free_mib(ctx.device)
            sync_weights(base, engine, bucket_mb=4)  # wakes the weights only
            again = engine.generate(prompts, SEEDED).responses
            outcome.expect(again.equal(awake), "after sleep, a sync and the wake the samples differ")
            if ctx.cuda and free_awake is not None and free_asleep is not None:
                freed = free_asleep - free_awake
                budget = 0.3 * torch.cuda.mem_get_info(ctx.device)[1] / 2**20
                outcome.summary["sleep_freed_mib"] = round(freed, 1)
                outcome.expect(
                    freed >= 0.5 * budget, f"sleep freed {freed:.0f} MiB of a {budget:.0f} MiB engine budget"
                )
        finally:
            _close(engine)
    if ctx.cuda and torch.cuda.device_count() >= 2:
        _tensor_parallel(ctx, outcome, model_dir, base)
    elif ctx.cuda:
        outcome.details["tp2"] = "skipped: needs 2 GPUs"


def _tensor_parallel(ctx: Context, outcome: Outcome, model_dir: str, base: torch.nn.Module) -> None:
    """TP=2 in two spawned processes that each see one GPU; both must give the TP=1 greedy tokens."""
    import torch.multiprocessing as mp

    out = ctx.workdir / "vllm_tp2"
    out.mkdir(parents=True, exist_ok=True)
    with single_rank_world(ctx.device):
        engine, config = _engine(model_dir, ctx.device)
        try:
            sync_prompts = prompt_batch(model_dir, config.data, 4, 56, ctx.seed)
            from vlrl.rollout import sync_weights

            sync_weights(base, engine, bucket_mb=1)
            expected = engine.generate(sync_prompts, GREEDY).responses
        finally:
            _close(engine)
    mp.start_processes(_tp_rank, args=(free_port(), model_dir, str(out), ctx.seed), nprocs=2,
                       start_method="spawn")  # fmt: skip
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    outcome.details["tp2"] = {"all_reduce": ranks[0]["all_reduce"]}
    for r, result in enumerate(ranks):
        outcome.expect(result["responses"].equal(expected), f"TP=2 rank {r}: greedy tokens differ from TP=1")


def _tp_rank(rank: int, port: int, model_dir: str, out_dir: str, seed: int) -> None:
    """A TP=2 peer seeing only GPU `rank` (CUDA_VISIBLE_DEVICES, as Ray sets it)."""
    import datetime

    import torch.distributed as dist

    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)  # before CUDA initializes in this process
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    from vlrl.models.loading import load_model
    from vlrl.rollout import sync_weights, vllm_settings

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    dist.init_process_group(
        "cuda:nccl,cpu:gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    result: dict[str, Any] = {"all_reduce": vllm_settings.all_reduce_settings(2, 1, True).describe()}
    try:
        engine, config = _engine(model_dir, device, tp=2)
        sync_weights(load_model(model_dir, dtype=torch.float32), engine, bucket_mb=1)
        result["responses"] = engine.generate(
            prompt_batch(model_dir, config.data, 4, 56, seed), GREEDY
        ).responses
        engine.close()
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
