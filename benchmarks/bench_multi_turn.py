"""Multi-turn rollout throughput vs single-turn generation of the same token count, and time in tools.

    python examples/prepare_multi_turn_demo.py          # the warmed-up demo model and data
    python benchmarks/bench_multi_turn.py [--prompts 64] [--n 4] [--repeats 3]

Multi-turn: the demo's prompts through the engine's tool loop (calls to `reveal`, images back).
Single-turn: the same prompts, `ignore_eos`, `max_tokens` = the multi-turn call's mean sampled
tokens per trajectory, so both sample the same number of tokens. Reported: sampled tokens/s of each
(fastest of `--repeats` interleaved runs), their ratio, and the share of the multi-turn wall time
spent in tool calls (the pool's `call`, including its process round trips).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from vlrl.config import DataConfig, MultiTurnConfig, RolloutConfig
from vlrl.data.collate import collate_prompts
from vlrl.data.prepare import RowPreparer
from vlrl.models.processor import load_processor
from vlrl.rollout import create_rollout_engine, sync_weights

DEMO = Path("outputs/multi_turn_demo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForImageTextToText

    model_dir = str(DEMO / "model")
    data = DataConfig(max_prompt_length=128, max_response_length=64, min_pixels=12544, max_pixels=12544,
                      format_prompt="format_prompts/shapes.jinja")  # fmt: skip
    tokenizer, processor = load_processor(model_dir)
    preparer = RowPreparer(data, tokenizer, processor, AutoConfig.from_pretrained(model_dir))
    rows = [json.loads(line) for line in (DEMO / "data" / "train_mt.jsonl").read_text().splitlines()]
    samples = [
        preparer.sample(r, str(DEMO / "data"), i, use_processor=False)
        for i, r in enumerate(rows[: args.prompts])
    ]
    prompts = collate_prompts(samples, tokenizer.pad_token_id)

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mt = MultiTurnConfig(
        enable=True, tools=["examples/tools/reveal.py:reveal"], max_assistant_turns=2, tool_workers=2
    )
    config = RolloutConfig(
        dtype="fp32", gpu_memory_utilization=0.2, max_num_seqs=256, n=args.n, multi_turn=mt
    )
    multi = create_rollout_engine(config, data, model_dir, tokenizer, processor)
    sync_weights(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32), multi, 64)
    pool = multi.multi_turn.pool
    tool_seconds = [0.0]
    original_call = pool.call

    def timed_call(calls):
        start = time.perf_counter()
        try:
            return original_call(calls)
        finally:
            tool_seconds[0] += time.perf_counter() - start

    pool.call = timed_call
    best_mt = best_st = float("inf")
    tokens = calls = errors = 0
    share = 0.0
    for r in range(args.repeats):
        tool_seconds[0] = 0.0
        start = time.perf_counter()
        batch = multi.generate(prompts, {"seed": r})
        wall = time.perf_counter() - start
        if wall < best_mt:
            best_mt, share = wall, tool_seconds[0] / wall
            tokens = int(batch.response_mask.sum())
            calls = sum(t["num_tool_calls"] for t in batch.trajectories)
            errors = sum(t["tool_errors"] for t in batch.trajectories)
        # the same engine without the tool loop: one generation of the same sampled-token count
        multi.multi_turn, saved = None, multi.multi_turn
        per_sample = max(1, round(tokens / len(batch)))
        start = time.perf_counter()
        single = multi.generate(prompts, {"seed": r, "ignore_eos": True, "max_tokens": per_sample})
        best_st = min(best_st, time.perf_counter() - start)
        multi.multi_turn = saved
    # ignore_eos: every single-turn sample ran to max_tokens (its mask would stop at a sampled EOS)
    single_tokens = len(single) * int(single.responses.shape[1])
    mt_rate, st_rate = tokens / best_mt, single_tokens / best_st
    print(f"trajectories: {len(batch)}  tool calls: {calls} ({errors} malformed or failed)  "
          f"sampled tokens: multi {tokens}, single {single_tokens}")  # fmt: skip
    print(
        f"multi-turn : {best_mt:.2f} s  {mt_rate:,.0f} sampled tokens/s  (tools: {100 * share:.2f}% of the time)"
    )
    print(f"single-turn: {best_st:.2f} s  {st_rate:,.0f} sampled tokens/s")
    print(f"ratio multi/single: {mt_rate / st_rate:.2f}x")
    multi.close()


if __name__ == "__main__":
    main()
