"""Multi-turn rollouts on the real vLLM engine (one rank, fp32 on CPU), with a tiny Qwen2.5-VL taught
to call tools on cue: text and image results, a hanging tool, a malformed call, overflow, and the
engine's log-probs over all turns against the actor's recomputation of the whole trajectory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from mt_helpers import CUES, mt_rollout_config, taught_model
from rollout_helpers import (
    close_world,
    data_config,
    free_port,
    init_world,
    load_hf_model,
    one_rank_actor,
    prompt_batch,
)

from vlrl.models.processor import load_processor
from vlrl.models.tiny import build_tiny_model
from vlrl.rollout import create_rollout_engine, sync_weights

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0.0, "n": 1, "seed": 3}


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    path = str(build_tiny_model(tmp_path_factory.mktemp("mt_model"), "qwen2_5_vl", tool_tokens=True))
    stats = taught_model(path, steps=120)
    assert stats["loss_last"] < 0.05, stats
    set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it process-wide
    init_world(0, 1, free_port())
    tokenizer, processor = load_processor(path)
    engine = create_rollout_engine(
        mt_rollout_config(calculate_log_probs=True), data_config(160), path, tokenizer, processor
    )
    sync_weights(load_hf_model(path), engine, bucket_mb=1)
    yield SimpleNamespace(path=path, engine=engine, prompts=prompt_batch(path, [c[0] for c in CUES]))
    engine.close()
    close_world()
    torch.set_num_threads = set_num_threads


def test_tool_calls_text_image_hang_malformed(mt):
    batch = mt.engine.generate(mt.prompts, GREEDY)
    show, add, hang, bad = batch.trajectories
    assert show["tool_calls"][0] | {"result": None} == {
        "name": "show", "arguments": {"colour": "red"}, "result": None, "images": 1, "error": False, "timed_out": False,
    }  # fmt: skip
    assert show["tool_calls"][0]["result"] == "here is red"
    assert len(batch.images[0]) == 1 and batch.images[0][0].size == (
        56,
        56,
    )  # the tool's image joined the sample
    assert len(batch.images[1]) == 1  # the prompt's image
    assert add["tool_calls"][0]["result"] == "3" and add["final_response"] == "3"
    assert hang["tool_calls"][0]["timed_out"] and hang["tool_timeouts"] == 1
    assert bad["tool_calls"][0]["name"] is None and bad["tool_errors"] == 1
    assert "not valid JSON" in bad["tool_calls"][0]["result"]
    for info in batch.trajectories:
        assert info["num_turns"] == 2 and info["stop_reason"] == "eos", info
        assert info["final_response"] == {"show": "red", "add": "3"}.get(info["tool_calls"][0]["name"], "no")
    # image tokens of the tool's image are in the response, as context
    image_id = mt.engine.hf_config.image_token_id
    in_response = batch.responses[0] == image_id
    assert in_response.sum() == 4 and not batch.response_mask[0][in_response].any()


def test_overflow_truncates_cleanly(mt):
    """A response budget that the tool turn does not fit ends the trajectory at the call."""
    batch = mt.engine.generate(mt.prompts.select([0]), {**GREEDY, "max_tokens": 40})
    info = batch.trajectories[0]
    assert info["stop_reason"] == "overflow" and info["num_turns"] == 1
    assert int(batch.attention_mask[0, batch.prompt_length :].sum()) <= 40
    assert (
        batch.response_mask[0].sum() == batch.attention_mask[0, batch.prompt_length :].sum()
    )  # no context kept


def test_engine_log_probs_match_actor_over_all_turns(mt):
    batch = mt.engine.generate(mt.prompts, {"temperature": 1.0, "n": 2, "seed": 5})
    assert sum(info["num_turns"] >= 2 for info in batch.trajectories) >= 4  # tool turns inside responses
    holes = (batch.attention_mask[:, batch.prompt_length :] == 1) & (batch.response_mask == 0)
    assert holes.any()
    actor = one_rank_actor(mt.path, temperature=1.0)
    actor_log_probs = actor.compute_log_probs(batch, 1.0)
    mask = batch.response_mask.bool()
    diff = (actor_log_probs - batch.rollout_log_probs).abs()[mask]
    assert diff.max() < 2e-4, diff.max()
    assert batch.rollout_log_probs[mask].lt(-1e-3).any()


def _trajectory_facts(batch):
    return [
        {k: info[k] for k in ("messages", "tool_calls", "stop_reason", "num_turns")}
        for info in batch.trajectories
    ]


def test_continuous_loop_matches_per_turn_loop(mt):
    """Greedy: driving vLLM request by request gives the per-turn loop's trajectories, token for token."""
    prompts = mt.prompts.select([0, 1, 3])  # no hanging tool: it only costs time here
    assert mt.engine.continuous_turns
    batch = mt.engine.generate(prompts, GREEDY)
    mt.engine.continuous_turns = False
    try:
        reference = mt.engine.generate(prompts, GREEDY)
    finally:
        mt.engine.continuous_turns = True
    assert all(info["num_turns"] == 2 for info in batch.trajectories)
    assert torch.equal(batch.responses, reference.responses)
    assert torch.equal(batch.response_mask, reference.response_mask)
    assert torch.equal(batch.attention_mask, reference.attention_mask)
    assert torch.equal(batch.position_ids, reference.position_ids)
    assert _trajectory_facts(batch) == _trajectory_facts(reference)


def test_continuous_loop_is_a_function_of_the_seed(mt):
    """Sampled: the same seed gives the same trajectories (no timing in the schedule); another does not."""
    prompts = mt.prompts.select([0, 1, 3])
    sampled = {"temperature": 1.0, "n": 4}
    first = mt.engine.generate(prompts, {**sampled, "seed": 11})
    again = mt.engine.generate(prompts, {**sampled, "seed": 11})
    other = mt.engine.generate(prompts, {**sampled, "seed": 12})
    assert sum(info["num_turns"] >= 2 for info in first.trajectories) >= 6  # tool turns inside responses
    assert torch.equal(first.responses, again.responses)
    assert torch.equal(first.rollout_log_probs, again.rollout_log_probs)
    assert _trajectory_facts(first) == _trajectory_facts(again)
    assert not torch.equal(first.responses, other.responses)
