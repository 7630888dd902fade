"""Multi-turn rollout throughput (per-turn loop and continuous loop) vs single-turn generation.

    python examples/prepare_multi_turn_demo.py          # the warmed-up demo model and data
    python benchmarks/bench_multi_turn.py [--prompts 64] [--n 4] [--repeats 3] [--cases short long long-small]
        [--tool-delay-ms 0] [--tool-workers 2] [--block-sizes 32]

Cases (all on the demo's prompts and `reveal` tool, fp32, one rank):
- short: the demo's model: a call (~8 sampled tokens), the tool turn (image + colour), a 2-token answer.
- long: a tiny model fitted here (once, to outputs/multi_turn_bench/) to write 24-72 filler words
  before its call and again before its answer, so turns are ~64+ sampled tokens of varying length,
  as when a model reasons before acting.
- long-small: the same with the `small` tiny-model size (~30 M parameters; fitting takes ~3 min).

Per case, interleaved in one engine: each of `--repeats` repetitions runs the five modes below back to back
and prints their tokens/s; the summary gives the median tokens/s, the median ratio to each
single-turn run of the same repetition, with every repetition's ratio (a shared machine's load
swings absolute rates several-fold between minutes; a repetition's five runs see about the same load):
- per-turn: `engine.continuous_turns=False`, one `LLM.generate` call per turn (the old loop);
- continuous: requests driven step by step, a sample's next turn queued as soon as its tool answered
  (calls run between engine steps);
- overlapped: continuous with `multi_turn.overlap_tools`: calls run while the engine decodes the
  other samples (`--tool-delay-ms` makes the tool slow, where this matters);
- single-turn: the same prompts without tools, `ignore_eos`, `max_tokens` = the continuous call's mean
  sampled tokens per trajectory, so all three sample about the same number of tokens;
- matched: single-turn again, but trajectory i samples exactly as many tokens as it did in the
  continuous call (`ignore_eos`, one request each): the same tokens with the same length spread,
  without the tool turns. A fixed length has no tail of long samples, which real rollouts (single-
  or multi-turn) have; the engine then runs far fewer steps, many of them nearly empty in the tail.
Reported: sampled tokens/s of each, the ratios to both single-turn runs, the share of each multi-turn wall
time spent waiting on or checking for tool results (the pool's `poll`, process round trips
included), and what a resumed turn costs in ms over the matched run (`turn_cost_ms`); the ratio
then depends on how that cost compares with an engine step (case `long-small`: a 6-layer,
512-wide model, ~5x the tiny one's step).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vlrl.config import DataConfig, MultiTurnConfig, RolloutConfig
from vlrl.data.collate import collate_prompts
from vlrl.data.prepare import RowPreparer
from vlrl.models.processor import load_processor
from vlrl.rollout import create_rollout_engine, sync_weights, vllm_hooks

DEMO = Path("outputs/multi_turn_demo")
BENCH = Path("outputs/multi_turn_bench")
FILLER = ["the", "shape", "is", "grey", "so", "look", "at", "it", "again", "which", "colour", "maybe", "call"]
# case -> (model, max_response_length, size of the filler model fitted here or None for the demo's)
# (name, engine.continuous_turns, multi_turn.overlap_tools)
MULTI_TURN_MODES = (("per-turn", False, False), ("continuous", True, False), ("overlapped", True, True))
CASES = {
    "short": (DEMO / "model", 64, None),
    "long": (BENCH / "model", 320, "tiny"),
    "long-small": (BENCH / "model_small", 320, "small"),
}


def build_long_model(model_dir: Path, size: str, steps: int = 80) -> None:
    """A model of the demo's family and `size`, fitted to write filler before its call and before
    its answer."""
    import importlib.util

    from vlrl.models.tiny import build_tiny_model

    spec = importlib.util.spec_from_file_location("demo", "examples/prepare_multi_turn_demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    build_tiny_model(model_dir, "qwen2_5_vl", size, seed=0, min_pixels=demo.PIXELS, max_pixels=demo.PIXELS,
                     tool_tokens=True)  # fmt: skip

    def filler(rng: random.Random) -> str:
        return " ".join(rng.choice(FILLER) for _ in range(rng.randint(24, 72))) + " "

    stats = demo.warm_up(model_dir, DEMO / "data" / "train_mt.jsonl", steps, batch_size=8, filler=filler)
    (model_dir / "turn_warmup.json").write_text(json.dumps(stats))
    print(
        f"long-turn {size} model: loss {stats['loss_first']:.2f} -> {stats['loss_last']:.2f} in {stats['seconds']:.0f} s"
    )


def load_prompts(model_dir: Path, data: DataConfig, count: int) -> Any:
    tokenizer, processor = load_processor(str(model_dir))
    from transformers import AutoConfig

    preparer = RowPreparer(data, tokenizer, processor, AutoConfig.from_pretrained(model_dir))
    rows = [json.loads(line) for line in (DEMO / "data" / "train_mt.jsonl").read_text().splitlines()]
    samples = [
        preparer.sample(r, str(DEMO / "data"), i, use_processor=False) for i, r in enumerate(rows[:count])
    ]
    return collate_prompts(samples, tokenizer.pad_token_id), tokenizer, processor


def timed_generate(
    engine: Any, prompts: Any, overrides: dict[str, Any], tool_seconds: list[float]
) -> tuple[float, Any, float]:
    tool_seconds[0] = 0.0
    start = time.perf_counter()
    batch = engine.generate(prompts, overrides)
    wall = time.perf_counter() - start
    return wall, batch, tool_seconds[0] / wall


def matched_single_turn(engine: Any, prompts: Any, lengths: list[int], seed: int) -> tuple[float, int]:
    """(wall, tokens) of one single-turn generation where trajectory i samples exactly `lengths[i]`
    tokens (`ignore_eos`, a request per trajectory): the multi-turn call's own length spread
    without its tool turns. A fixed-length reference has no tail; this one has the same tail."""
    import dataclasses

    from vlrl.rollout.base import resolve_sampling, seeded_rng

    n = len(lengths) // len(prompts)
    settings = resolve_sampling(engine.config, engine.data_config.max_response_length, {"ignore_eos": True})
    engine.llm.reset_prefix_cache()
    engine.image_ids.clear()
    requests = engine.requests(prompts)
    inputs = [requests[i // n] for i in range(len(lengths))]
    params = [
        engine.sampling_params(dataclasses.replace(settings, n=1, max_tokens=max(1, int(k)))) for k in lengths
    ]
    start = time.perf_counter()
    with seeded_rng(seed):
        outputs = engine.llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return wall, sum(len(o.outputs[0].token_ids) for o in outputs)


def summary_line(mode: str, runs: list[dict[str, tuple[float, int, float, Any]]]) -> str:
    """Median tokens/s of `mode`, its median ratio to each single-turn reference (every repetition's
    ratio in brackets) and, for the multi-turn modes, calls, tokens per turn and the tools' share."""

    def rate(run: dict[str, tuple[float, int, float, Any]], m: str) -> float:
        return run[m][1] / run[m][0]

    line = f"{mode:<12} {statistics.median(rate(run, mode) for run in runs):8,.0f} tokens/s"
    for ref in ("single-turn", "matched"):
        ratios = [rate(run, mode) / rate(run, ref) for run in runs]
        line += f"  {statistics.median(ratios):.2f}x {ref} ({' '.join(f'{x:.2f}' for x in ratios)})"
    if mode in ("single-turn", "matched"):
        return line
    _, tokens, _, batch = runs[-1][mode]
    infos = batch.trajectories
    calls = sum(t["num_tool_calls"] for t in infos)
    errors = sum(t["tool_errors"] for t in infos)
    turn_tokens = tokens / max(1, sum(t["num_turns"] for t in infos))
    share = statistics.median(run[mode][2] for run in runs)
    extra_ms = statistics.median(turn_cost_ms(run, mode) for run in runs)
    return line + (
        f"  calls {calls} ({errors} failed), {turn_tokens:.0f} tokens/turn, tools {100 * share:.1f}%, "
        f"+{extra_ms:.1f} ms per resumed turn"
    )


def turn_cost_ms(run: dict[str, tuple[float, int, float, Any]], mode: str) -> float:
    """What a resumed turn (a tool or user turn and the assistant turn after it) costs over the
    matched single-turn run: (multi-turn wall - matched wall) / resumed turns, in ms. The matched
    run samples the same tokens per trajectory, so the difference is the turns' own work: the tool,
    rendering, the new request, the tool turn's prefill and its image's encoding."""
    wall, _, _, batch = run[mode]
    resumed = sum(t["num_turns"] - 1 for t in batch.trajectories)
    return 1000 * (wall - run["matched"][0]) / max(1, resumed)


def run_case(name: str, args: argparse.Namespace) -> None:
    from transformers import AutoModelForImageTextToText

    model_dir, response_length, _ = CASES[name]
    data = DataConfig(max_prompt_length=128, max_response_length=response_length, min_pixels=12544,
                      max_pixels=12544, format_prompt="format_prompts/shapes.jinja", prompt_key="problem",
                      answer_key="answer", image_key="images")  # fmt: skip
    prompts, tokenizer, processor = load_prompts(model_dir, data, args.prompts)
    # the tool workers read the delay when they start, with the engine
    os.environ["VLRL_BENCH_TOOL_DELAY_MS"] = str(args.tool_delay_ms)
    tool = "benchmarks/slow_tools.py:reveal" if args.tool_delay_ms else "examples/tools/reveal.py:reveal"
    mt = MultiTurnConfig(enable=True, tools=[tool], max_assistant_turns=2, tool_workers=args.tool_workers)
    config = RolloutConfig(
        dtype="fp32", gpu_memory_utilization=0.2, max_num_seqs=256, n=args.n, multi_turn=mt
    )
    engine = create_rollout_engine(config, data, str(model_dir), tokenizer, processor)
    sync_weights(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32), engine, 64)
    pool = engine.multi_turn.pool
    tool_seconds = [0.0]

    def timed(method: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                tool_seconds[0] += time.perf_counter() - start

        return run

    # every wait on (or check for) tool results goes through `poll`, `call`'s included
    pool.poll = timed(pool.poll)
    # one row per repetition: mode -> (wall, sampled tokens, tool share, batch); the three modes of a
    # repetition run back to back, so a load change on a shared machine hits a repetition's modes
    # alike and its ratios to single-turn stay comparable even when the absolute rates swing
    runs: list[dict[str, tuple[float, int, float, Any]]] = []
    per_sample = 0  # single-turn tokens per sample: the first continuous call's mean, then fixed
    for r in range(args.repeats):
        run: dict[str, tuple[float, int, float, Any]] = {}
        for mode, continuous, overlap in MULTI_TURN_MODES:
            engine.continuous_turns, engine.multi_turn.config.overlap_tools = continuous, overlap
            wall, batch, share = timed_generate(engine, prompts, {"seed": r}, tool_seconds)
            run[mode] = (wall, int(batch.response_mask.sum()), share, batch)
        per_sample = per_sample or max(1, round(run["continuous"][1] / len(run["continuous"][3])))
        # the same engine without the tool loop: one generation of the same sampled-token count
        engine.multi_turn, saved = None, engine.multi_turn
        wall, single, _ = timed_generate(
            engine, prompts, {"seed": r, "ignore_eos": True, "max_tokens": per_sample}, [0.0]
        )
        engine.multi_turn = saved
        # ignore_eos: every sample ran to max_tokens (its mask would stop at a sampled EOS)
        run["single-turn"] = (wall, len(single) * int(single.responses.shape[1]), 0.0, single)
        lengths = run["continuous"][3].response_mask.sum(-1).tolist()  # each trajectory's sampled tokens
        run["matched"] = (*matched_single_turn(engine, prompts, lengths, seed=r), 0.0, None)
        runs.append(run)
        rates = {mode: tokens / wall for mode, (wall, tokens, _, _) in run.items()}
        print(f"[{name} repetition {r + 1}] " + "  ".join(
            f"{mode} {rate:,.0f} tok/s" for mode, rate in rates.items()
        ))  # fmt: skip
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    print(
        f"\n== {name}: {len(runs[0]['continuous'][3])} trajectories ({args.prompts} prompts x {args.n}), "
        f"model {model_dir}, KV blocks of {block} tokens, median of {len(runs)} repetitions; ratios to "
        "the fixed-length and the matched-lengths single-turn runs of the same repetition"
    )
    for mode in runs[0]:
        print(summary_line(mode, runs))
    engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--long-model-steps", type=int, default=80)
    parser.add_argument("--tool-delay-ms", type=float, default=0.0, help="the tool sleeps this long first")
    parser.add_argument("--tool-workers", type=int, default=2)
    parser.add_argument(
        "--block-sizes", nargs="+", type=int, default=[vllm_hooks.CPU_BLOCK_SIZE],
        help="CPU KV-cache block sizes to run each case with (multiples of 32), one engine each",
    )  # fmt: skip
    args = parser.parse_args()
    for name in args.cases:
        model_dir, _, size = CASES[name]
        if size is not None and not (model_dir / "turn_warmup.json").exists():
            build_long_model(model_dir, size, args.long_model_steps)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    for name in args.cases:
        for block in args.block_sizes:
            vllm_hooks.CPU_BLOCK_SIZE = block  # read by vllm_engine.llm_kwargs when the engine starts
            run_case(name, args)


if __name__ == "__main__":
    main()
