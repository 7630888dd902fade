"""What the spawned ranks of tests/rollout/test_mt_tensor_parallel.py run.

- `run_shared_tools`: 4 ranks, tensor-parallel groups {0, 1} and {2, 3}, `SharedTools` alone (no
  vLLM): calls, an interaction, submitted and polled calls, and a leader whose pool fails to start.
- `run_engine`: 2 ranks, one vLLM engine over both (TP=2), multi-turn rollouts with tools whose
  answers differ per process (`mt_tp_tools.py`), greedy and then sampled with `overlap_tools`;
  every batch of turns a rank queues is logged (`log_submissions`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from mt_helpers import CUES, TOOLS, mt_config
from rollout_helpers import close_world, data_config, init_world, load_hf_model, prompt_batch, rollout_config

from vlrl.rollout.multi_turn.shared_tools import SharedTools, build_tp_group
from vlrl.rollout.multi_turn.tool_config import tool_entries
from vlrl.rollout.multi_turn.tool_pool import ToolPool

TP_TOOLS = str(Path(__file__).with_name("mt_tp_tools.py"))
TP_NAMES = ["add", "show", "hang"]
GREEDY = {"temperature": 0.0, "n": 1, "seed": 3}
SAMPLED = {"temperature": 1.0, "n": 2, "seed": 5}


def _pool(mt: Any) -> ToolPool:
    return ToolPool(tool_entries(mt), mt.interaction, mt.tool_workers, mt.tool_timeout, mt.max_tool_images)


def _outputs(outputs: list[Any]) -> list[tuple[str, list[tuple[int, int]], bool, bool]]:
    return [(o.text, [i.size for i in o.images], o.error, o.timed_out) for o in outputs]


def run_shared_tools(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_world(rank, world_size, port)
    mt = mt_config(tools=[f"{TP_TOOLS}:{n}" for n in TP_NAMES], tool_workers=1, tool_timeout=2.0,
                   interaction=f"{TOOLS}:follow_up")  # fmt: skip
    tp = build_tp_group(2)
    assert tp is not None
    tools = SharedTools(lambda: _pool(mt), tp)
    result: dict[str, Any] = {"pid": os.getpid(), "leader": tp.leader, "has_pool": tools.pool is not None}
    calls = [("add", {"a": 1, "b": 2}, {}), ("show", {"colour": "red"}, {}), ("hang", {}, {})]
    result["call"] = _outputs(tools.call(calls))
    result["empty"] = (tools.call([]), tools.interact([]), tools.poll(set(), block=True))
    messages = [{"role": "assistant", "content": "3"}]
    result["interact"] = tools.interact([(messages, {"reply": "sure?"}), (messages, {})])
    tickets = tools.submit_calls(calls[:2])
    done: dict[int, Any] = {}
    while len(done) < len(tickets):
        done.update(tools.poll(set(tickets) - done.keys(), block=True))
    result["polled"] = (tickets, {t: _outputs([o])[0] for t, o in done.items()})
    tools.close()

    def broken_pool() -> ToolPool:
        raise ValueError(f"no tools on rank {rank}")

    try:
        SharedTools(broken_pool, tp)
    except Exception as exc:
        result["start_failure"] = f"{type(exc).__name__}: {exc}"
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    close_world()


def _facts(batch: Any) -> dict[str, Any]:
    return {
        "trajectories": batch.trajectories,
        "responses": batch.responses,
        "response_mask": batch.response_mask,
        "image_sizes": [[img.size for img in images] for images in batch.images],
    }


def log_submissions(path: Path) -> None:
    """Append every batch of turns this rank queues in vLLM to `path`, one JSON line of [sample key,
    turn, context ids] per batch, before vLLM sees it (a hang in the engine cannot hide it)."""
    from vlrl.rollout.multi_turn.vllm_turns import VLLMTurns

    submit = VLLMTurns.submit

    def logged(self: VLLMTurns, turns: list[Any]) -> None:
        if turns:
            with path.open("a") as file:
                file.write(json.dumps([[key, turn, ids] for key, ids, _, _, turn in turns]) + "\n")
        submit(self, turns)

    VLLMTurns.submit = logged  # type: ignore[method-assign]


def run_engine(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    from vlrl.models.processor import load_processor
    from vlrl.rollout import create_rollout_engine, sync_weights

    log_submissions(Path(out_dir) / f"submitted{rank}.jsonl")
    torch.set_num_threads(1)  # two ranks share the machine's cores
    init_world(rank, world_size, port)
    tokenizer, processor = load_processor(model_dir)
    config = rollout_config(tensor_parallel_size=2, gpu_memory_utilization=0.05, max_num_seqs=8)
    config.multi_turn = mt_config(tools=[f"{TP_TOOLS}:{n}" for n in TP_NAMES])
    engine = create_rollout_engine(config, data_config(160), model_dir, tokenizer, processor)
    loop = engine.multi_turn
    result: dict[str, Any] = {"pid": os.getpid(), "has_pool": loop.pool is not None}
    sync_weights(load_hf_model(model_dir), engine, bucket_mb=1)
    prompts = prompt_batch(model_dir, [c[0] for c in CUES])
    start = time.perf_counter()
    result["greedy"] = _facts(engine.generate(prompts, GREEDY))
    result["greedy_s"] = time.perf_counter() - start
    loop.config.overlap_tools = True  # which calls have finished at a step: the leader's timing
    result["overlap"] = _facts(engine.generate(prompts, SAMPLED))
    # frames torch.compile traced in this process (vllm_engine.eager_small_helpers: none on CPU)
    result["compiled_frames"] = torch._dynamo.utils.counters["frames"]["total"]
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    engine.close()
    close_world()
