"""Peak host memory of the response log-probs at a 152k vocabulary: all logits vs the chunked lm head.

    .venv/bin/python benchmarks/bench_logprob_memory.py                      # default sizes (CPU)
    .venv/bin/python benchmarks/bench_logprob_memory.py --lengths 512 4096 --grad-lengths 1024 --old-max 256

A one-layer Qwen2 with a Qwen-sized vocabulary (152,064) and a small hidden size (64), fp32 on
CPU, scores 16 packed rows of a 16-token prompt and R response tokens (M = 16 R scored tokens),
log-probs and the entropy metric on temperature 0.7, two ways:
- `full logits` (the path before vlrl.models.lm_head, kept here only): the model's forward runs
  the lm head over all kept positions, [M, V] logits, then `score_tokens` scores them in chunks;
- `chunked head` (`forward_log_probs`): the forward returns hidden states [M, H] and the head runs
  per LOGIT_CHUNK tokens inside the checkpointed chunk function.
Each case runs in a fresh process; the reported number is the growth of its peak RSS
(`resource.getrusage(...).ru_maxrss`) over its RSS just before the pass: one no-grad pass (old /
reference log-probs) or one forward + backward (the update). The model, inputs and the
parameters' gradient buffers (allocated by a warm-up backward on a tiny batch) exist before, so
the number is what the pass itself needs. The body (1 layer, H = 64) is small next to the logits.

Results (this 2-core, 24 GiB CPU machine, shared; GiB of peak RSS growth; seconds are noisy):

| R | M | pass | full logits | chunked head | full / chunked |
|---|---|---|---|---|---|
| 128 | 2048 | no-grad | 4.64 | 4.65 | 1.0x |
| 256 | 4096 | no-grad | 5.80 | 4.66 | 1.2x |
| 512 | 8192 | no-grad | 8.12 | 4.66 | 1.7x |
| 4096 | 65536 | no-grad | ~40.6 (extrapolated) | 4.66 | ~8.7x |
| 128 | 2048 | fwd+bwd | 6.96 | 5.80 | 1.2x |
| 256 | 4096 | fwd+bwd | 9.28 | 5.87 | 1.6x |
| 1024 | 16384 | fwd+bwd | ~23.2 (extrapolated) | 5.95 | ~3.9x |
| 4096 | 65536 | fwd+bwd | ~78.9 (extrapolated) | 6.36 | ~12x |

The full-logits path grows by one (no-grad) or two (fwd+bwd: the logits and their gradient)
[2048, V] fp32 tensors, 1.16 GiB each, per 2048 tokens; beyond 8192 tokens (no-grad) / 4096
(fwd+bwd) it does not fit next to the other jobs on this machine, so its larger rows are that
line extended. The chunked head stays at one chunk's temporaries (~4 fp32 [2048, V] tensors);
its fwd+bwd grows by the body's activations only (0.56 GiB from 2k to 64k tokens).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

import torch

VOCAB = 152_064
ROWS = 16
PROMPT = 16


def build_model() -> torch.nn.Module:
    """A 1-layer Qwen2 (hidden 64) with the 152k vocabulary, fp32, varlen (packed) attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from vlrl.models.attention import VARLEN_ATTENTION, set_text_attention

    config = AutoConfig.for_model(
        "qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8192,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    set_text_attention(model, VARLEN_ATTENTION)
    return model


def make_inputs(response_length: int, seed: int = 0) -> Any:
    """Packed inputs for ROWS rows of PROMPT + `response_length` random tokens (all real)."""
    from vlrl.models.packing import build_packed_inputs

    gen = torch.Generator().manual_seed(seed)
    length = PROMPT + response_length
    ids = torch.randint(0, VOCAB, (ROWS, length), generator=gen)
    mask = torch.ones(ROWS, length, dtype=torch.long)
    pos = torch.arange(length).expand(ROWS, length).contiguous()
    return build_packed_inputs(ids, mask, pos, PROMPT, attention_backend="loop")


def full_logits_log_probs(model: torch.nn.Module, inputs: Any, sampling: Any, grad: bool) -> Any:
    """The path before the chunked head: [1, M, V] logits from the forward, scored in chunks."""
    from vlrl.models.packing import score_tokens

    logits = model(**inputs.model_kwargs, use_cache=False).logits  # [1, M, V]
    m = inputs.rows.numel()
    anchor = 0.0 * logits[0, m:].sum(dtype=torch.float32)
    log_probs, entropy = score_tokens(logits[0, :m], inputs.targets, sampling, True, False)
    return log_probs, entropy, anchor


def chunked_log_probs(model: torch.nn.Module, inputs: Any, sampling: Any, grad: bool) -> Any:
    from vlrl.models.packing import forward_log_probs

    out = forward_log_probs(model, inputs, sampling, True, False)
    return out.log_probs, out.entropy, out.anchor


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_case(path: str, response_length: int, grad: bool) -> dict[str, float]:
    """In this (fresh) process: peak RSS growth (bytes) and seconds of one pass."""
    from vlrl.models.sampling import SamplingDistribution

    torch.set_num_threads(2)
    model = build_model()
    sampling = SamplingDistribution(0.7)
    fn = full_logits_log_probs if path == "full" else chunked_log_probs
    # warm-up on 2 response tokens: allocates the parameters' .grad buffers and lazy state
    small = make_inputs(2, seed=1)
    with torch.set_grad_enabled(grad):
        lp, _, anchor = fn(model, small, sampling, grad)
        if grad:
            (lp.sum() + anchor).backward()
    inputs = make_inputs(response_length)
    del lp, anchor
    before = rss_bytes()
    start = time.perf_counter()
    with torch.set_grad_enabled(grad):
        lp, _, anchor = fn(model, inputs, sampling, grad)
        if grad:
            (lp.sum() + anchor).backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"growth": peak - before, "seconds": seconds}


def measure(path: str, response_length: int, grad: bool) -> dict[str, float]:
    """`run_case` in a fresh Python process (ru_maxrss is per process and never goes down)."""
    cmd = [sys.executable, __file__, "--case", path, str(response_length), str(int(grad))]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="*", default=[128, 256, 512], help="no-grad pass")
    parser.add_argument("--grad-lengths", type=int, nargs="*", default=[128, 256], help="forward + backward")
    parser.add_argument("--old-max", type=int, default=512, help="longest response for the full-logits path")
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        path, length, grad = args.case
        print(json.dumps(run_case(path, int(length), bool(int(grad)))))
        return
    from vlrl.models.packing import LOGIT_CHUNK

    print(f"vocab {VOCAB}, {ROWS} rows, fp32 on CPU, LOGIT_CHUNK {LOGIT_CHUNK}; peak RSS growth of one pass")
    print("| R | scored tokens M | pass | full logits (GiB) | chunked head (GiB) | full / chunked "
          "| seconds full / chunked |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for grad, lengths in ((False, args.lengths), (True, args.grad_lengths)):
        for length in lengths:
            new = measure("chunked", length, grad)
            old = measure("full", length, grad) if length <= args.old_max else None
            name = "fwd+bwd" if grad else "no-grad"
            ratio = f"{old['growth'] / new['growth']:.1f}x" if old else "-"
            old_gib = f"{old['growth'] / 2**30:.2f}" if old else "not run (> --old-max)"
            old_s = f"{old['seconds']:.1f}" if old else "-"
            print(f"| {length} | {ROWS * length} | {name} | {old_gib} | {new['growth'] / 2**30:.2f} | {ratio} "
                  f"| {old_s} / {new['seconds']:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
