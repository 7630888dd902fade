"""CPU rollout throughput by KV-cache block size (why `vllm_hooks.CPU_BLOCK_SIZE` is 32).

    python benchmarks/bench_block_size.py [--sizes tiny small] [--tokens 64 256 1024] [--blocks 32 128]

Each setting (model size, response tokens, block size) runs in its own process (one vLLM engine
each): 128 prompts x 4 samples with one image, `ignore_eos`, through `VLLMRolloutEngine.generate`.
Settings take turns over `--rounds` rounds so a load change on a shared machine hits them alike; the
table gives each one's best tokens/s and its ratio to the first block size.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

MODELS = Path("outputs/bench_block_size")


def child(size: str, tokens: int, block: int, dtype: str) -> None:
    """Print the best tokens/s of three `generate` calls with `block`-token KV blocks."""
    import torch
    import torch.distributed as dist
    from bench_rollout import make_prompts
    from transformers import AutoModelForImageTextToText

    from vlrl.config import DataConfig, RolloutConfig
    from vlrl.models.tiny import build_tiny_model
    from vlrl.rollout import create_rollout_engine, sync_weights, vllm_hooks

    vllm_hooks.CPU_BLOCK_SIZE = block  # read by vllm_engine.llm_kwargs when the engine starts
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29615")
    dist.init_process_group("gloo")
    model_dir = MODELS / size
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, "qwen2_5_vl", size=size)
    data = DataConfig(max_prompt_length=256, max_response_length=tokens, min_pixels=28 * 28 * 4,
                      max_pixels=28 * 28 * 36, prompt_key="problem")  # fmt: skip
    prompts, tokenizer, processor = make_prompts(str(model_dir), 128, data)
    engine = create_rollout_engine(
        RolloutConfig(n=4, dtype=dtype, gpu_memory_utilization=0.2, max_num_seqs=512),
        data, str(model_dir), tokenizer, processor,
    )  # fmt: skip
    assert engine.llm.llm_engine.vllm_config.cache_config.block_size == block
    sync_weights(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32), engine, 16)
    sampling = {"n": 4, "temperature": 1.0, "ignore_eos": True, "max_tokens": tokens, "seed": 0}
    engine.generate(prompts.select(list(range(8))), sampling)  # warm-up
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        batch = engine.generate(prompts, sampling)
        best = max(best, batch.responses.numel() / (time.perf_counter() - start))
    print(f"TOKENS_PER_S {best:.1f}")
    engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[64, 256, 1024])
    parser.add_argument("--blocks", nargs="+", type=int, default=[32, 128])
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=3, metavar=("SIZE", "TOKENS", "BLOCK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        size, tokens, block = args.child
        child(size, int(tokens), int(block), args.dtype)
        return
    settings = [(s, t, b) for s in args.sizes for t in args.tokens for b in args.blocks]
    best: dict[tuple[str, int, int], float] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.getcwd()])}
    for _ in range(args.rounds):
        for s, t, b in settings:
            cmd = [sys.executable, __file__, "--child", s, str(t), str(b), "--dtype", args.dtype]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            rate = float(out.split("TOKENS_PER_S")[-1].split()[0])
            best[s, t, b] = max(best.get((s, t, b), 0.0), rate)
    first = args.blocks[0]
    print(f"\nCPU rollout, {args.dtype}, 128 prompts x 4, best of 3 calls x {args.rounds} rounds (tokens/s)")
    print(f"{'model':>6} {'tokens':>6} " + " ".join(f"{f'block {b}':>11}" for b in args.blocks)
          + "  " + " ".join(f"{f'{b}/{first}':>7}" for b in args.blocks[1:]))  # fmt: skip
    for s in args.sizes:
        for t in args.tokens:
            rates = [best[s, t, b] for b in args.blocks]
            print(f"{s:>6} {t:>6} " + " ".join(f"{r:11,.0f}" for r in rates)
                  + "  " + " ".join(f"{r / rates[0]:7.2f}" for r in rates[1:]))  # fmt: skip


if __name__ == "__main__":
    main()
