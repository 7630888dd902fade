"""Hybrid sharding (`worker.actor.fsdp.fsdp_size`): bytes each rank sends across nodes per optimizer step.

    .venv/bin/python benchmarks/bench_hybrid_shard_bytes.py                 # tiny Qwen2 text model, CPU
    .venv/bin/python benchmarks/bench_hybrid_shard_bytes.py --size small --micro-batches 2

Four gloo ranks (CPU) stand for 2 nodes x 2 ranks: ranks {0, 1} are node 0, {2, 3} node 1. Each
trains the same rows with `Actor.update_policy` (one optimizer step per call), once with flat
sharding (fsdp_size -1: a 1-D mesh of 4) and once hybrid (fsdp_size 2: a 2-D mesh [2 replicate,
2 shard], each shard group one node). Every torch.distributed collective the step makes (FSDP2's
`all_gather_single` / `reduce_scatter_single` / `all_reduce`, the actor's metric all-reduces) is
wrapped and attributed to its process group: the group's ranks are compared with the mesh's groups.

Byte model (what must leave a rank, independent of the library's ring/tree choice): a rank sends its
piece directly to each other member of the group. all-gather of a b-byte shard: b to each other
member; reduce-scatter of an input of k x b bytes (group of k): b to each other member; all-reduce
of n bytes: a reduce-scatter plus an all-gather, 2 n / k to each other member. "cross-node" counts
only the bytes whose receiver is on the other node. CPU runs fp32 weights and gradients (GPU
gathers bf16 weights, halving the all-gather bytes; gradients stay fp32, `mp_reduce_dtype`).
Collectives DTensor runs itself (the grad-norm's `full_tensor`, a few bytes) go through
functional collectives and are not seen.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from vlrl.batch.rows import RolloutBatch
from vlrl.config import PPOConfig
from vlrl.models.tiny import build_tiny_model
from vlrl.workers.actor import Actor
from vlrl.workers.from_config import build_actor

WORLD, PER_NODE = 4, 2
LAYOUTS = (("flat", -1), ("hybrid 2x2", PER_NODE))
# name -> (input argument position, input keyword, per-member bytes from the input's bytes and group size)
WRAPPED: dict[str, tuple[int, str, Callable[[int, int], float]]] = {
    "all_gather_single": (1, "input_tensor", lambda nbytes, k: nbytes),
    "all_gather_into_tensor": (1, "input_tensor", lambda nbytes, k: nbytes),
    "reduce_scatter_single": (1, "input", lambda nbytes, k: nbytes / k),
    "reduce_scatter_tensor": (1, "input", lambda nbytes, k: nbytes / k),
    "all_reduce": (0, "tensor", lambda nbytes, k: 2 * nbytes / k),
}


def node_of(rank: int) -> int:
    return rank // PER_NODE


class ByteCounter:
    """Wraps the collectives in `WRAPPED` on `torch.distributed`; sums bytes per (collective, group)."""

    def __init__(self, labels: dict[tuple[int, ...], str]) -> None:
        self.labels = labels  # group ranks -> name (the mesh's groups)
        self.rank = dist.get_rank()
        self.on = False
        self.calls: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        self.originals = {name: getattr(dist, name) for name in WRAPPED}
        for name in WRAPPED:
            setattr(dist, name, self._wrap(name))

    def _wrap(self, name: str) -> Callable[..., Any]:
        original, (position, keyword, _) = self.originals[name], WRAPPED[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                tensor = kwargs[keyword] if keyword in kwargs else args[position]
                self._count(name, kwargs.get("group"), tensor.numel() * tensor.element_size())
            return original(*args, **kwargs)

        return counted

    def _count(self, name: str, group: Any, nbytes: int) -> None:
        ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(WORLD))
        piece = WRAPPED[name][2](nbytes, len(ranks))  # bytes to each other member
        others = [r for r in ranks if r != self.rank]
        remote = [r for r in others if node_of(r) != node_of(self.rank)]
        label = "default (world)" if group is None else self.labels.get(ranks, str(list(ranks)))
        row = self.calls[(name, label)]
        row[0] += 1
        row[1] += piece * len(others)
        row[2] += piece * len(remote)

    def restore(self) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)


def mesh_labels(actor: Actor) -> dict[tuple[int, ...], str]:
    """Ranks of this rank's group along each mesh dim -> "<dim> [ranks]"."""
    mesh = next(actor.model.module.parameters()).device_mesh
    labels = {}
    for dim, name in enumerate(mesh.mesh_dim_names or ()):
        ranks = tuple(dist.get_process_group_ranks(mesh.get_group(dim)))
        labels[ranks] = f"{name} {list(ranks)}"
    return labels


def make_config(model_dir: str, fsdp_size: int, rows: int, micro: int) -> PPOConfig:
    config = PPOConfig()
    actor = config.worker.actor
    actor.model.model_path = model_dir
    actor.model.enable_gradient_checkpointing = False
    actor.fsdp.fsdp_size = fsdp_size
    actor.global_batch_size = rows * WORLD  # one optimizer step per update_policy
    actor.micro_batch_size_per_device_for_update = max(rows // micro, 1)
    config.worker.rollout.n = 1
    config.algorithm.disable_kl = True
    config.trainer.n_gpus_per_node = WORLD
    config.trainer.device = "cpu"
    config.derive()
    return config


def text_batch(rows: int, length: int, vocab: int, seed: int) -> RolloutBatch:
    """`rows` random text sequences of `length` tokens (8 prompt tokens), advantages +-1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=gen)
    prompt, response = 8, length - 8
    return RolloutBatch(
        input_ids=ids, attention_mask=torch.ones(rows, length, dtype=torch.long),
        position_ids=torch.arange(length).expand(rows, length).contiguous(),
        responses=ids[:, prompt:], response_mask=torch.ones(rows, response, dtype=torch.long),
        group_ids=torch.arange(rows), prompt_length=prompt, images=[[] for _ in range(rows)],
        prompts=["p"] * rows, ground_truths=[None] * rows, extras=[{} for _ in range(rows)],
        old_log_probs=torch.zeros(rows, response),
        advantages=(torch.rand(rows, 1, generator=gen) - 0.5).sign().expand(rows, response).contiguous(),
    )  # fmt: skip


def run_rank(rank: int, world: int, port: int, model_dir: str, args: argparse.Namespace, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        for name, fsdp_size in LAYOUTS:
            actor = build_actor(make_config(model_dir, fsdp_size, args.rows, args.micro_batches), None, "cpu")
            vocab = int(actor.model.hf_config.vocab_size)
            batch = text_batch(args.rows, args.length, vocab, seed=rank)
            actor.update_policy(batch)  # warm-up step: optimizer states are created here
            counter = ByteCounter(mesh_labels(actor))
            counter.on = True
            for _ in range(args.steps):
                actor.update_policy(batch)
            counter.restore()
            params = sum(p.numel() for p in actor.model.module.parameters())
            results[name] = {"calls": dict(counter.calls), "params": params}
            del actor
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(results: list[dict[str, Any]], steps: int) -> None:
    """Rank 0's rows per collective and group (every rank's cross-node totals agree: symmetric)."""
    mib = 2**20
    print(
        f"\nparameters: {results[0]['flat']['params']:,} (fp32); per rank, per optimizer step (mean of {steps})"
    )
    print("| layout | collective | group | calls | sent (MiB) | sent across nodes (MiB) |")
    print("|---|---|---|---|---|---|")
    for name, _ in LAYOUTS:
        for (collective, group), (calls, sent, remote) in sorted(results[0][name]["calls"].items()):
            print(f"| {name} | {collective} | {group} | {calls / steps:g} | {sent / steps / mib:.3f} "
                  f"| {remote / steps / mib:.3f} |")  # fmt: skip
    print("\n| layout | sent across nodes per step, each rank (MiB) |")
    print("|---|---|")
    for name, _ in LAYOUTS:
        per_rank = [sum(row[2] for row in r[name]["calls"].values()) / steps / mib for r in results]
        print(f"| {name} | {' / '.join(f'{b:.3f}' for b in per_rank)} |")


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="tiny", help="vlrl.models.tiny size of the Qwen2 text model")
    parser.add_argument("--rows", type=int, default=2, help="rows per rank per optimizer step")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per rank per step")
    parser.add_argument("--length", type=int, default=64, help="tokens per row")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps counted (after one warm-up)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(os.path.join(tmp, "model"), arch="qwen2", size=args.size))
        mp.start_processes(run_rank, args=(WORLD, free_port(), model_dir, args, tmp), nprocs=WORLD,
                           start_method="fork")  # fmt: skip
        report(
            [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)],
            args.steps,
        )


if __name__ == "__main__":
    main()
