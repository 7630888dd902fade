"""Check: two ranks (two GPUs over NCCL; gloo processes in the CPU self-test).

- FSDP gradients across two ranks (each holds half the rows) equal one rank's on all the rows;
- Ulysses `ulysses_size=2` (both ranks hold every row, each runs half of every packed row's tokens,
  all-to-alls queued on the CUDA stream) gives the log-probs and gradients of `ulysses_size=1`;
- `fsdp.enable_cpu_offload` (shards on the host, gathered to the GPU per unit) the same again (CUDA).
The actor computes in fp32 (TF32 off) so the comparisons are tight: what differs is only the
reduction order. Skipped on a machine with one GPU: NCCL refuses two ranks of one communicator on
the same device ("Duplicate GPU detected").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from vlrl.tools.gpu_check.context import Context, free_port, single_rank_world
from vlrl.tools.gpu_check.inputs import make_config, prompt_batch, random_rollout, training_fields
from vlrl.tools.gpu_check.logprob_check import _grad_gap, _no_tf32
from vlrl.tools.gpu_check.report import Outcome

ROWS = ([0, 3, 4, 7], [1, 2, 5, 6])  # each rank's rows without sequence parallelism (4 prompts x 2)
BOUND = 1e-4  # fp32: relative gradient error, max log-prob error


def _config(model_dir: str, device: torch.device, **values: Any):
    fp32 = {"worker.actor.fsdp.mp_param_dtype": "fp32", "algorithm.use_kl_loss": False,
            "worker.actor.global_batch_size": 8, "data.rollout_batch_size": 4, "worker.rollout.n": 2}  # fmt: skip
    return make_config(model_dir, device, **{**fp32, **values})


def _grads(
    model_dir: str, device: torch.device, batch, world: int = 1, **values: Any
) -> tuple[torch.Tensor, dict]:
    """(log-probs [n, R], full gradients by name) of one `forward_backward` of `batch` (ratio 1)."""
    from vlrl.models.processor import load_processor
    from vlrl.workers.actor import _UpdateStats, gathered_grads
    from vlrl.workers.from_config import build_actor

    config = _config(model_dir, device, **{"trainer.n_gpus_per_node": world, **values})
    actor = build_actor(config, load_processor(model_dir)[1], device, model_path=model_dir)
    actor.model.module.train()
    log_probs = actor.forward_backward(
        batch, _UpdateStats(with_kl_loss=False), image_anchor=True, own_old=True
    )
    grads = {k: v.float().cpu() for k, v in gathered_grads(actor.model.module).items()}
    del actor
    return log_probs, grads


def _rank_main(rank: int, world: int, port: int, model_dir: str, cuda: bool, out_dir: str) -> None:
    """One spawned rank: every variant on its rows; rank 0 saves the results."""
    import datetime

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1 if not cuda else torch.get_num_threads())  # two CPU ranks share the cores
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    batch = torch.load(Path(out_dir) / "batch.pt", weights_only=False)
    variants: dict[str, tuple[list[int], dict[str, Any]]] = {
        "dp2": (ROWS[rank], {}),
        "sp2": (list(range(len(batch))), {"worker.actor.ulysses_size": 2}),
    }
    if cuda:
        variants["cpu_offload"] = (ROWS[rank], {"worker.actor.fsdp.enable_cpu_offload": True})
    results: dict[str, Any] = {}
    try:
        with _no_tf32():
            for name, (rows, values) in variants.items():
                log_probs, grads = _grads(model_dir, device, batch.select(rows), world, **values)
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, (rows, log_probs))
                full = torch.zeros(batch.responses.shape)
                for part_rows, part in gathered:
                    full[part_rows] = part
                results[name] = (full, grads)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, Path(out_dir) / "rank0.pt")


def check_two_ranks(ctx: Context, outcome: Outcome) -> None:
    import torch.multiprocessing as mp

    if ctx.cuda and torch.cuda.device_count() < 2:
        outcome.skipped = (
            f"needs 2 GPUs ({torch.cuda.device_count()} visible): NCCL refuses two ranks on one device"
        )
        return
    model_dir = ctx.tiny_model("qwen2_5_vl")
    out = ctx.workdir / "two_ranks"
    out.mkdir(parents=True, exist_ok=True)
    config = _config(model_dir, ctx.device)
    prompts = prompt_batch(model_dir, config.data, 4, 56, ctx.seed)
    batch = training_fields(random_rollout(model_dir, prompts, 2, [9, 4, 14, 6], 1000, ctx.seed), ctx.seed)
    with single_rank_world(ctx.device), _no_tf32():
        reference = _grads(model_dir, ctx.device, batch)  # one rank, every row
    torch.save(batch, out / "batch.pt")
    mp.start_processes(_rank_main, args=(2, free_port(), model_dir, ctx.cuda, str(out)), nprocs=2,
                       start_method="spawn")  # fmt: skip
    results = torch.load(out / "rank0.pt", weights_only=False)
    mask = batch.response_mask.bool()
    for name, (log_probs, grads) in results.items():
        lp_err = float((log_probs - reference[0])[mask].abs().max())
        grad_err = _grad_gap(grads, reference[1])
        outcome.summary.update({f"{name}_lp_err": lp_err, f"{name}_grad_rel": grad_err})
        outcome.expect(grads.keys() == reference[1].keys(), f"{name}: other parameters have gradients")
        outcome.expect(lp_err <= BOUND, f"{name}: log-probs differ from one rank's by {lp_err:.3g}")
        outcome.expect(
            grad_err <= BOUND, f"{name}: gradients differ from one rank's by {grad_err:.3g} (relative)"
        )
