"""Multi-turn rollouts on the real vLLM engine (one rank, fp32 on CPU), with a tiny Qwen2.5-VL taught
to call tools on cue: text and image results, a hanging tool, a malformed call, overflow, an
interaction answering as the user, and the engine's log-probs over all turns against the actor's
recomputation of the whole trajectory."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from mt_helpers import CUES, FOLLOW_UP, FOLLOW_UP_ROW, mt_rollout_config
from mt_spmd_job import SHARDS
from mt_spmd_job import run as run_rank
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
from vlrl.rollout import create_rollout_engine, sync_weights

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0.0, "n": 1, "seed": 3}


@pytest.fixture(scope="module")
def mt(taught_tool_model):
    path = taught_tool_model
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
    actor_log_probs = actor.compute_log_probs(batch)
    mask = batch.response_mask.bool()
    diff = (actor_log_probs - batch.rollout_log_probs).abs()[mask]
    assert diff.max() < 2e-4, diff.max()
    assert batch.rollout_log_probs[mask].lt(-1e-3).any()


def test_interaction_replies_as_the_user_then_ends(mt, tmp_path):
    """The interaction asks once after the first final answer and ends the episode after the second:
    the user turn sits in the response as context, rendered as the chat template renders it."""
    log = tmp_path / "interaction.jsonl"
    row = {**CUES[FOLLOW_UP_ROW][0], "tools_kwargs": {"interaction": {"reply": FOLLOW_UP, "log": str(log)}}}
    batch = mt.engine.generate(prompt_batch(mt.path, [row]), GREEDY)
    (info,) = batch.trajectories
    assert [m["role"] for m in info["messages"]] == ["assistant", "tool", "assistant", "user", "assistant"]
    assert info["messages"][3]["content"] == FOLLOW_UP and info["final_response"] == "3"
    assert (info["num_turns"], info["num_user_turns"], info["num_tool_calls"]) == (3, 1, 1)
    assert info["stop_reason"] == "eos"
    # asked after each final answer: once with no user turn (replies), once after it (ends)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [
        ["assistant", "tool", "assistant"],
        ["assistant", "tool", "assistant", "user", "assistant"],
    ]
    # the response is the Qwen chat format of the conversation, one <|im_end|> closing each turn;
    # the model's turns are trained (mask 1), the tool and user turns are context (mask 0, log-prob 0)
    tokenizer = load_processor(mt.path)[0]
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    segments = [
        (call, 1),
        ("<|im_end|>\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n", 0),
        ("3<|im_end|>", 1),
        (f"\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n", 0),
        ("3<|im_end|>", 1),
    ]
    ids = [tokenizer.encode(text, add_special_tokens=False) for text, _ in segments]
    expected_mask = [flag for (_, flag), part in zip(segments, ids) for _ in part]
    length = int(batch.attention_mask[0, batch.prompt_length :].sum())
    assert batch.responses[0, :length].tolist() == [i for part in ids for i in part]
    assert batch.response_mask[0, :length].tolist() == expected_mask
    context = batch.response_mask[0, :length] == 0
    assert batch.rollout_log_probs[0, :length][context].eq(0).all()


def test_two_ranks_multi_turn(mt, tmp_path):
    """Two SPMD ranks (gloo world, external_launcher), each its own engine and tool workers, roll out
    their own shards: an image-returning tool call on both, well-formed trajectories, and the same
    greedy trajectory as the one-rank engine for the same prompt."""
    mp.start_processes(
        run_rank, args=(2, free_port(), mt.path, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["dp_rank"] for r in ranks] == [0, 1]
    reference = mt.engine.generate(mt.prompts.select([0]), GREEDY)
    ref_length = int(reference.attention_mask[0, reference.prompt_length :].sum())
    image_id = mt.engine.hf_config.image_token_id
    for rank, rows in zip(ranks, SHARDS):
        P = rank["prompt_length"]
        for i, (row, info) in enumerate(zip(rows, rank["trajectories"])):
            roles = [m["role"] for m in info["messages"]]
            assert roles == ["assistant", "tool", "assistant"] and info["stop_reason"] == "eos", info
            assert info["final_response"] == CUES[row][3]
            real = rank["attention_mask"][i, P:].bool()
            mask = rank["response_mask"][i]
            assert (
                not mask[~real].any() and mask[real][0] == 1 and mask[real][-1] == 1
            )  # model turns at both ends
            assert not mask[rank["responses"][i] == image_id].any()  # tool image tokens are context
        show = rank["trajectories"][0]
        assert show["tool_calls"][0]["images"] == 1 and rank["image_sizes"][0] == [(56, 56)]
        length = int(rank["attention_mask"][0, P:].sum())
        assert length == ref_length
        assert rank["responses"][0, :length].equal(reference.responses[0, :ref_length])
        assert rank["response_mask"][0, :length].equal(reference.response_mask[0, :ref_length])
    assert ranks[0]["trajectories"][1]["tool_calls"][0]["result"] == "3"
    assert ranks[1]["trajectories"][1]["tool_errors"] == 1  # the malformed call, answered with an error


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


def test_overlapped_tools_let_the_other_samples_finish_first(mt, monkeypatch):
    """overlap_tools: while the hanging tool runs out its timeout, the other samples get their
    results and finish their answers; the blocking loop makes every sample wait for it. Greedy
    tokens do not depend on the schedule, so both give the same trajectories."""
    events: list[tuple[str, int, int]] = []  # (what, prompt row, assistant turns so far)
    loop = mt.engine.multi_turn
    take_turn, add_result = loop._take_turn, loop._add_result

    def logged_take_turn(t, *args):
        take_turn(t, *args)
        events.append(("turn", t.prompt_row, t.assistant_turns))

    def logged_add_result(t, *args):
        add_result(t, *args)
        events.append(("result", t.prompt_row, t.assistant_turns))

    monkeypatch.setattr(loop, "_take_turn", logged_take_turn)
    monkeypatch.setattr(loop, "_add_result", logged_add_result)

    def run(overlap: bool):
        events.clear()
        monkeypatch.setattr(loop.config, "overlap_tools", overlap)
        batch = mt.engine.generate(mt.prompts, GREEDY)
        hang_result = events.index(("result", 2, 1))
        finished_before = {row for what, row, turns in events[:hang_result] if what == "turn" and turns == 2}
        return batch, finished_before

    overlapped, finished_early = run(True)
    blocking, finished_blocking = run(False)
    assert finished_early == {0, 1, 3}  # show, add and the malformed call answered during the hang
    # blocking: show and add called in the hang's step, so they wait out its timeout (the shorter
    # malformed call ends earlier and may finish before)
    assert not finished_blocking & {0, 1}
    assert all(info["num_turns"] == 2 for info in overlapped.trajectories)
    assert overlapped.trajectories[2]["tool_timeouts"] == 1
    assert torch.equal(overlapped.responses, blocking.responses)
    assert torch.equal(overlapped.response_mask, blocking.response_mask)
    assert torch.equal(overlapped.position_ids, blocking.position_ids)
    assert _trajectory_facts(overlapped) == _trajectory_facts(blocking)
