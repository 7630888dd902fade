"""Update efficiency: vlrl's `Actor.update_policy` against a bare torch training loop, same work.

    .venv/bin/python benchmarks/bench_update_efficiency.py                   # ~112M Qwen2, CPU
    .venv/bin/python benchmarks/bench_update_efficiency.py --rounds 5 --checkpointing
    .venv/bin/python benchmarks/bench_update_efficiency.py --profile         # top ops of each

Both sides train the same randomly initialised Qwen2-architecture text model (fp32, CPU; default
hidden 768, 10 layers, vocab 32,000: ~112M parameters, so matrix work dominates) on the same rows
(`--rows` sequences, prompts of 40-120 tokens, responses of 100-300, all response tokens scored),
split into the same micro-batches (`--micro` rows each), with one AdamW step (same lr, betas,
weight decay) and grad-norm clipping to 1.0 per update:

(a) vlrl: `Actor.update_policy` on a 1-rank gloo process group (FSDP2 over one rank, packed rows,
    the chunked lm head, PPO clipped loss, the entropy metric, the non-finite checks).
(b) bare: the same HF model without FSDP, loaded by the same `load_model` (so the same packed
    attention, vlrl.models.attention's varlen function, on one packed row per micro-batch): the
    decoder's hidden states of the scored positions, the lm head on them ([M, V] logits at once),
    log-softmax, the PPO clipped loss (token mean), backward, `clip_grad_norm_`, AdamW step.

Gradient checkpointing is off on both sides (on on both with --checkpointing). Tokens/s counts
real (prompt + response) tokens; the two sides alternate `--rounds` times in one process so load
drift on these shared CPUs hits both alike, and the median of each is reported with the ratio.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from vlrl.batch.rows import RolloutBatch
from vlrl.config import PPOConfig
from vlrl.models.attention import make_varlen_info
from vlrl.models.loading import load_model
from vlrl.models.tiny import build_tiny_model
from vlrl.workers.actor import Actor
from vlrl.workers.from_config import build_actor
from vlrl.workers.fsdp import apply_fsdp

LR, CLIP_LOW, CLIP_HIGH, MAX_NORM = 1e-5, 0.2, 0.3, 1.0


def build_model_dir(out: str, hidden: int, layers: int, vocab: int) -> str:
    """The `small` tiny Qwen2 folder (tokenizer, generation config), its weights replaced by a larger
    random model: `hidden`, `layers`, intermediate 8/3 x hidden, 12 heads of 64, 4 KV heads."""
    path = str(build_tiny_model(out, arch="qwen2", size="small"))
    config = AutoConfig.from_pretrained(path)
    config.hidden_size, config.num_hidden_layers, config.vocab_size = hidden, layers, vocab
    config.intermediate_size = 8 * hidden // 3 // 64 * 64
    config.num_attention_heads, config.num_key_value_heads = hidden // 64, 4
    config.tie_word_embeddings = False
    config.layer_types = ["full_attention"] * layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def make_batch(rows: int, vocab: int, seed: int) -> RolloutBatch:
    """`rows` sequences [left-padded prompt | right-padded response], advantages +-1 per row."""
    rng = random.Random(seed)
    prompts = [rng.randint(40, 120) for _ in range(rows)]
    responses = [rng.randint(100, 300) for _ in range(rows)]
    p_len, r_len = max(prompts), max(responses)
    ids = torch.zeros(rows, p_len + r_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    gen = torch.Generator().manual_seed(seed)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, p_len - p : p_len + r] = torch.randint(1, vocab, (p + r,), generator=gen)
        mask[i, p_len - p : p_len + r] = 1
    resp_mask = mask[:, p_len:]
    return RolloutBatch(
        input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        responses=ids[:, p_len:].contiguous(), response_mask=resp_mask, group_ids=torch.arange(rows),
        prompt_length=p_len, images=[[] for _ in range(rows)], prompts=[""] * rows,
        ground_truths=[None] * rows, extras=[{} for _ in range(rows)],
        # old = current policy +- a little: some ratios clip, like a second PPO epoch
        old_log_probs=-10.4 + 0.05 * torch.randn(rows, r_len, generator=gen),
        advantages=(torch.rand(rows, 1, generator=gen) - 0.5).sign() * resp_mask,
    )  # fmt: skip


def make_config(model_dir: str, micro: int, checkpointing: bool) -> PPOConfig:
    config = PPOConfig()
    actor = config.worker.actor
    actor.model.model_path = model_dir
    actor.model.enable_gradient_checkpointing = checkpointing
    actor.dynamic_batching = False  # the bare loop takes the same fixed micro-batches
    actor.micro_batch_size_per_device_for_update = micro
    actor.global_batch_size = 10**6  # one optimizer step per update: all rows in one mini-batch
    actor.optim.lr = LR
    actor.clip_ratio_low, actor.clip_ratio_high, actor.max_grad_norm = CLIP_LOW, CLIP_HIGH, MAX_NORM
    config.algorithm.disable_kl = True
    config.worker.rollout.n = 1
    config.trainer.n_gpus_per_node = 1
    config.trainer.device = "cpu"
    config.derive()
    return config


class BareLoop:
    """The plain torch update (b): no vlrl update code; see the module docstring. `fsdp`: the model
    sharded by vlrl's `apply_fsdp` over the 1-rank group (side c: what FSDP2 itself costs)."""

    def __init__(self, model_dir: str, checkpointing: bool, banned: list[int], fsdp: bool = False) -> None:
        self.model = load_model(model_dir, padding_free=True, gradient_checkpointing=checkpointing)
        if fsdp:
            apply_fsdp(self.model, torch.device("cpu"), PPOConfig().worker.actor.fsdp)
        self.model.train()
        opt = PPOConfig().worker.actor.optim  # vlrl's defaults: betas, weight decay
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=LR, betas=tuple(opt.betas), weight_decay=opt.weight_decay
        )
        self.banned = torch.tensor(banned, dtype=torch.long)

    def micro_inputs(self, batch: RolloutBatch, rows: list[int]) -> dict[str, Any]:
        """One packed row [1, T] of `rows`, the kept positions [M] and their targets/old/advantages."""
        p_len = batch.prompt_length
        ids, keep, targets, old, adv, lengths, start = [], [], [], [], [], [], 0
        for i in rows:
            real = batch.attention_mask[i].bool()
            seq = batch.input_ids[i][real]  # [L_i]
            prompt = int(real[:p_len].sum())
            resp = int(batch.response_mask[i].sum())
            ids.append(seq)
            lengths.append(seq.numel())
            # hidden state at t scores token t + 1: response token j is scored at prompt + j - 1
            keep.append(torch.arange(start + prompt - 1, start + prompt + resp - 1))
            targets.append(batch.responses[i, :resp])
            old.append(batch.old_log_probs[i, :resp])  # type: ignore[index]
            adv.append(batch.advantages[i, :resp])  # type: ignore[index]
            start += seq.numel()
        packed = torch.cat(ids)
        positions = torch.cat([torch.arange(n) for n in lengths])
        return {
            "ids": packed[None], "positions": positions[None], "keep": torch.cat(keep),
            "targets": torch.cat(targets), "old": torch.cat(old), "adv": torch.cat(adv),
            "varlen": make_varlen_info(lengths, "cpu", "auto"),
        }  # fmt: skip

    def loss(self, x: dict[str, Any], num_tokens: int) -> torch.Tensor:
        """PPO clipped loss of one micro-batch, this micro-batch's share of the token mean."""
        # the lm head on the kept positions only (transformers' `logits_to_keep` index tensor)
        logits = self.model(
            input_ids=x["ids"], position_ids=x["positions"], vlrl_varlen=x["varlen"],
            logits_to_keep=x["keep"], use_cache=False,
        ).logits[0].float()  # [M, V]  # fmt: skip
        logits = logits.index_fill(1, self.banned, float("-inf"))  # the engines' ban list, as vlrl
        log_probs = F.log_softmax(logits, -1).gather(1, x["targets"][:, None])[:, 0]  # [M]
        ratio = torch.exp(log_probs - x["old"])
        adv = x["adv"]
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
        return pg.sum() / num_tokens

    def update(self, batch: RolloutBatch, micro: int) -> None:
        num_tokens = int(batch.response_mask.sum())
        for first in range(0, len(batch), micro):
            x = self.micro_inputs(batch, list(range(first, min(first + micro, len(batch)))))
            self.loss(x, num_tokens).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: all its threads, less sensitive to other load)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def profile(name: str, fn: Callable[[], Any], rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    print(f"\n## {name}: top ops by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=8, help="sequences per update (one optimizer step)")
    parser.add_argument("--micro", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--rounds", type=int, default=3, help="timed updates of each side, alternated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on both")
    parser.add_argument("--profile", type=int, default=0, help="print the top N ops of one update each")
    parser.add_argument("--fsdp-bare", action="store_true", help="add (c): the bare loop on the FSDP2 model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(os.path.join(tmp, "model"), args.hidden, args.layers, args.vocab)
        config = make_config(model_dir, args.micro, args.checkpointing)
        actor: Actor = build_actor(config, None, "cpu")
        banned = list(actor.model.banned_token_ids)
        bare = BareLoop(model_dir, args.checkpointing, banned)
        batch = make_batch(args.rows, args.vocab, seed=0)
        sides: dict[str, Callable[[], Any]] = {
            "(a) vlrl update_policy": lambda: actor.update_policy(batch),
            "(b) bare torch loop": lambda: bare.update(batch, args.micro),
        }
        if args.fsdp_bare:
            sharded = BareLoop(model_dir, args.checkpointing, banned, fsdp=True)
            sides["(c) bare loop, FSDP2 model"] = lambda: sharded.update(batch, args.micro)
        for fn in sides.values():
            fn()  # warm-up: optimizer states, allocator
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, fn in sides.items():
                times[name].append(timed(fn))
        if args.profile:
            for name, fn in sides.items():
                profile(name, fn, args.profile)
    dist.destroy_process_group()
    report(args, actor, batch, times)


def report(
    args: argparse.Namespace, actor: Actor, batch: RolloutBatch, times: dict[str, list[tuple[float, float]]]
) -> None:
    params = sum(p.numel() for p in actor.model.module.parameters())
    tokens = int(batch.attention_mask.sum())
    print(
        f"\n{params / 1e6:.1f}M parameters (fp32), {args.rows} rows, {tokens} tokens "
        f"({int(batch.response_mask.sum())} scored), micro-batches of {args.micro} rows, "
        f"checkpointing {'on' if args.checkpointing else 'off'}, {args.threads} threads, "
        f"median of {args.rounds} alternated rounds"
    )
    print("| side | wall s / update (each round) | tokens/s (wall) | CPU s / update | tokens/CPU-s |")
    print("|---|---|---|---|---|")
    wall = {name: statistics.median(w for w, _ in t) for name, t in times.items()}
    cpu = {name: statistics.median(c for _, c in t) for name, t in times.items()}
    for name, t in times.items():
        rounds = ", ".join(f"{w:.1f}" for w, _ in t)
        print(f"| {name} | {wall[name]:.1f} ({rounds}) | {tokens / wall[name]:.0f} | {cpu[name]:.1f} "
              f"| {tokens / cpu[name]:.0f} |")  # fmt: skip
    names = list(times)
    for other in names[1:]:
        paired = statistics.median(b[0] / a[0] for a, b in zip(times[names[0]], times[other]))
        print(f"\nratio {names[0][:3]}/{other[:3]} tokens/s: wall {wall[other] / wall[names[0]]:.3f} "
              f"(median of per-round ratios {paired:.3f}), CPU time {cpu[other] / cpu[names[0]]:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
