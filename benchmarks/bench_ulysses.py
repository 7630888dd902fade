"""Ulysses sequence parallelism: activation memory per rank and the cost of the exchange.

    .venv/bin/python benchmarks/bench_ulysses.py                       # `small` tiny Qwen2.5-VL, CPU
    .venv/bin/python benchmarks/bench_ulysses.py --lengths 2048 8192 --repeats 2

Two gloo ranks (CPU, one thread each) train one long packed sequence (a short text prompt and a
random response, mrope positions) with `Actor.forward_backward`, with ulysses_size 1 (each rank
holds its own copy of the sequence) and 2 (the two ranks split it). Per rank it reports:
- activation memory: bytes of the tensors autograd saves for the backward (distinct storages,
  parameters excluded), i.e. what grows with the sequence and what sequence parallelism divides;
- fwd+bwd seconds (median over --repeats), and the seconds spent inside the attention all-to-alls
  (forward and backward; this includes waiting for the other rank to arrive), and the same
  all-to-alls by themselves after a barrier (the transfer cost alone). The log-prob gather moves
  a few KB and is not timed.
Gradient checkpointing is off so that every layer's activations are counted.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import vlrl.models.ulysses as ulysses
from vlrl.batch.rows import RolloutBatch
from vlrl.config import PPOConfig
from vlrl.models.processor import load_processor
from vlrl.models.tiny import build_tiny_model
from vlrl.workers.actor import Actor, _UpdateStats
from vlrl.workers.from_config import build_actor


def make_config(model_dir: str, sp: int) -> PPOConfig:
    config = PPOConfig()
    actor = config.worker.actor
    actor.model.model_path = model_dir
    actor.model.enable_gradient_checkpointing = False
    actor.ulysses_size = sp
    actor.micro_batch_size_per_device_for_update = 1
    actor.global_batch_size = 2 // sp
    config.worker.rollout.n = 1
    config.trainer.n_gpus_per_node = 2
    config.trainer.device = "cpu"
    config.derive()
    return config


def long_sample(length: int, vocab: int, prompt: int = 32, seed: int = 0) -> RolloutBatch:
    """One sequence of `length` tokens below `vocab` (no special tokens): `prompt` prompt tokens,
    the rest response (advantage 1, old log-probs 0: the PPO ratio is never clipped)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, length), generator=gen)
    response = length - prompt
    return RolloutBatch(
        input_ids=ids, attention_mask=torch.ones(1, length, dtype=torch.long),
        position_ids=torch.arange(length).expand(1, 3, length).contiguous(),
        responses=ids[:, prompt:], response_mask=torch.ones(1, response, dtype=torch.long),
        group_ids=torch.zeros(1, dtype=torch.long), prompt_length=prompt, images=[[]], prompts=["p"],
        ground_truths=[None], extras=[{}], old_log_probs=torch.zeros(1, response),
        advantages=torch.ones(1, response),
    )  # fmt: skip


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward, parameters excluded (FSDP swaps
    a unit's gathered weights in as plain parameters during its forward: those are skipped too)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.seen, self.bytes = module, set(), 0

    def _gathered_weights(self) -> set[int]:
        return {
            p.untyped_storage().data_ptr() for p in self.module.parameters() if not isinstance(p, DTensor)
        }

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            return t
        key = t.untyped_storage().data_ptr()
        if key not in self.seen and key not in self._gathered_weights():
            self.seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t


class ExchangeTimer:
    """Wraps `all_to_all_single` as the ulysses module calls it and sums the seconds spent in it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.original = dist.all_to_all_single

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.original(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def measure(actor: Actor, batch: RolloutBatch, timer: ExchangeTimer) -> tuple[int, float, float]:
    """(saved activation bytes, fwd+bwd seconds, exchange seconds) of one micro-batch."""
    probe = SavedBytes(actor.model.module)
    timer.seconds = 0.0
    actor.model.module.train()
    dist.barrier()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t):
        actor.forward_backward(batch, _UpdateStats(with_kl_loss=True), image_anchor=False)
    seconds = time.perf_counter() - start
    actor.optimizer.zero_grad(set_to_none=True)
    return probe.bytes, seconds, timer.seconds


def exchange_alone(actor: Actor, length: int, timer: ExchangeTimer, repeats: int = 3) -> float:
    """Seconds of one micro-batch's all-to-alls by themselves (after a barrier, so no waiting on
    the other rank's compute): per layer q, k, v and the output, forward and backward."""
    sp = actor.model.sp
    if sp is None:
        return 0.0
    text = getattr(actor.model.hf_config, "text_config", None) or actor.model.hf_config
    heads, dim = text.num_attention_heads, text.hidden_size // text.num_attention_heads
    kv = max(text.num_key_value_heads, sp.size)
    local = length // sp.size
    tensors = [torch.randn(h, local, dim) for h in (heads, kv, kv, heads)] * 2 * text.num_hidden_layers
    runs = []
    for _ in range(repeats):
        dist.barrier()
        timer.seconds = 0.0
        for t in tensors:
            timer(torch.empty_like(t), t, group=sp.group)
        runs.append(timer.seconds)
    return statistics.median(runs)


def run_rank(rank: int, port: int, model_dir: str, lengths: list[int], repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    timer = ExchangeTimer()
    ulysses.dist.all_to_all_single = timer  # type: ignore[assignment]
    tokenizer, processor = load_processor(model_dir)
    vocab = tokenizer.convert_tokens_to_ids("<|endoftext|>")  # the special tokens come after the text ones
    rows = []
    for sp in (1, 2):
        actor = build_actor(make_config(model_dir, sp), processor, "cpu", model_path=model_dir)
        measure(actor, long_sample(64, vocab), timer)  # warm-up: FSDP's lazy init, first-call costs
        for length in lengths:
            runs = [measure(actor, long_sample(length, vocab), timer) for _ in range(repeats)]
            saved = runs[0][0]
            seconds = statistics.median(r[1] for r in runs)
            exchange = statistics.median(r[2] for r in runs)
            rows.append((length, sp, saved, seconds, exchange, exchange_alone(actor, length, timer)))
        del actor
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model-dir", default=None, help="default: build the `small` tiny Qwen2.5-VL")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or str(build_tiny_model(os.path.join(tmp, "model"), size="small"))
        out = os.path.join(tmp, "rows.pt")
        mp.start_processes(
            _spawned,
            args=(free_port(), model_dir, args.lengths, args.repeats, out),
            nprocs=2,
            start_method="spawn",
        )
        rows = torch.load(out)
    print("| tokens | ulysses_size | tokens per rank | saved activations per rank (MiB) | vs sp=1 "
          "| fwd+bwd s | in all-to-all s (share) | all-to-alls alone s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    base = {length: saved for length, sp, saved, *_ in rows if sp == 1}
    for length, sp, saved, seconds, exchange, alone in rows:
        print(f"| {length} | {sp} | {length // sp} | {saved / 2**20:.0f} | {saved / base[length]:.2f}x "
              f"| {seconds:.2f} | {exchange:.3f} ({exchange / seconds:.1%}) | {alone:.3f} |")  # fmt: skip


def _spawned(rank: int, *args: Any) -> None:
    run_rank(rank, *args)


if __name__ == "__main__":
    main()
