"""Sleep levels of the vLLM engine and the guard after a level-2 sleep, without vLLM's sleep mode.

vLLM refuses sleep mode on CPU, so the engine's state machine is driven here with a stand-in for
`vllm.LLM` that records the calls; tests/gpu/test_vllm_sleep_and_logprobs.py runs the real thing.
Also: which generations the rank worker lets the engine discard its weights after, and the start-up
check on `algorithm.old_policy=rollout` with a truncated sampling distribution.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vlrl.batch.rows import FinishedGroups, RolloutBatch
from vlrl.config import ConfigError
from vlrl.config.loader import load_config
from vlrl.rollout import NoWeightsError, vllm_settings
from vlrl.rollout.base import sync_follows
from vlrl.rollout.vllm_engine import VLLMRolloutEngine, sleep_level
from vlrl.utils.busy_clock import BusyClock


@pytest.mark.parametrize(
    ("sleep_mode", "replaced", "level"),
    [(False, False, 0), (False, True, 0), (True, False, 1), (True, True, 2)],
)
def test_sleep_level(sleep_mode: bool, replaced: bool, level: int) -> None:
    """No sleep mode (CPU, rollout-only ranks): awake. Otherwise the weights are discarded only when
    a full sync comes next."""
    assert sleep_level(sleep_mode=sleep_mode, weights_replaced_next=replaced) == level


def step_config(filtering: bool = False, mini: int | None = None, estimator: str = "grpo") -> Any:
    return SimpleNamespace(
        data=SimpleNamespace(rollout_batch_size=8, mini_rollout_batch_size=mini),
        algorithm=SimpleNamespace(online_filtering=filtering, adv_estimator=estimator),
    )


@pytest.mark.parametrize(
    ("config", "training", "follows"),
    [
        (step_config(), True, True),  # the step's one round: the update's sync is next
        (step_config(), False, False),  # validation: a training generation comes next
        (step_config(mini=8), True, True),  # a mini batch as large as the batch: one round
        (step_config(mini=4), True, False),  # more rounds may follow
        (step_config(filtering=True), True, False),  # online filtering: more rounds may follow
        (step_config(estimator="remax"), True, False),  # ReMax's greedy pass follows
        (step_config(estimator="remax"), False, False),  # the greedy pass itself: maybe another round
    ],
)
def test_sync_follows(config: Any, training: bool, follows: bool) -> None:
    assert sync_follows(config, training) is follows


class FakeLLM:
    """Records sleep/wake/load calls as `vllm.LLM` would receive them; `fail_load`: the load raises."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_load = False
        self.llm_engine = SimpleNamespace(
            reset_encoder_cache=lambda: self.calls.append(("reset_encoder", None))
        )

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        return True

    def reset_prefix_cache(self) -> bool:
        return True

    def collective_rpc(self, fn: Any, args: tuple[Any, ...]) -> list[tuple[set[str], set[str]]]:
        if self.fail_load:
            raise RuntimeError("the load broke half-way")
        names = {name for bucket in args[0] for name, _ in bucket}
        self.calls.append(("load", sorted(names)))
        return [(names, {"w"})]


def fake_engine(sleep_enabled: bool = True) -> VLLMRolloutEngine:
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    engine.llm, engine.sleep_enabled, engine.family = FakeLLM(), sleep_enabled, "text"
    engine.has_weights = engine.weights_discarded = engine.asleep = False
    engine._asleep_tags = set()
    return engine


def load(engine: VLLMRolloutEngine) -> None:
    engine._load_buckets(iter([[("w", torch.zeros(1))]]))


def test_level_2_sleep_refuses_to_generate_until_a_full_sync() -> None:
    engine = fake_engine()
    load(engine)
    engine._require_weights()
    engine.sleep(weights_replaced_next=True)
    assert engine.llm.calls[-1] == ("sleep", 2) and engine.weights_discarded and not engine.has_weights
    with pytest.raises(NoWeightsError, match="slept at level 2"):
        engine._require_weights()
    with pytest.raises(NoWeightsError, match="slept at level 2"):
        next(engine.generate_stream(SimpleNamespace()))  # type: ignore[arg-type]  # the guard comes first
    engine.wake_up()  # the rank worker wakes before generating: memory back, weights still unusable
    with pytest.raises(NoWeightsError, match="slept at level 2"):
        engine._require_weights()
    engine.sleep(weights_replaced_next=True)
    load(engine)  # wakes the weights only, then loads every parameter
    assert engine.llm.calls[-3:] == [("wake_up", ["weights"]), ("load", ["w"]), ("reset_encoder", None)]
    assert engine.has_weights and not engine.weights_discarded and engine.asleep  # the KV cache sleeps
    engine._require_weights()


def test_level_1_sleep_keeps_the_weights() -> None:
    engine = fake_engine()
    load(engine)
    engine.sleep()
    assert engine.llm.calls[-1] == ("sleep", 1) and engine.has_weights and not engine.weights_discarded
    engine._require_weights()
    engine.sleep(weights_replaced_next=True)  # already asleep: nothing changes
    assert engine.llm.calls[-1] == ("sleep", 1) and engine.has_weights
    engine.wake_up()
    assert engine.llm.calls[-1] == ("wake_up", ["kv_cache", "weights"]) and not engine.asleep


def test_without_sleep_mode_nothing_is_discarded() -> None:
    engine = fake_engine(sleep_enabled=False)
    load(engine)
    engine.sleep(weights_replaced_next=True)
    assert ("sleep", 2) not in engine.llm.calls and engine.has_weights and not engine.asleep


def test_a_failed_load_leaves_the_engine_refusing() -> None:
    engine = fake_engine()
    load(engine)
    engine.llm.fail_load = True
    with pytest.raises(RuntimeError, match="half-way"):
        load(engine)
    with pytest.raises(NoWeightsError, match="last weight load failed"):
        engine._require_weights()


# ---------------------------------------------------------------------------- the rank worker
class RecordingEngine:
    def __init__(self, discarded: bool = False) -> None:
        self.calls: list[Any] = []
        self.weights_discarded = discarded

    def wake_up(self) -> None:
        self.calls.append("wake_up")

    def sleep(self, weights_replaced_next: bool = False) -> None:
        self.calls.append(("sleep", weights_replaced_next))

    def generate_stream(self, prompts: Any, overrides: Any) -> Iterator[Any]:
        self.calls.append("generate")
        yield FinishedGroups([0], [[1, 2]])
        yield RolloutBatch(
            input_ids=torch.ones(1, 2, dtype=torch.long), attention_mask=torch.ones(1, 2, dtype=torch.long),
            position_ids=torch.zeros(1, 2, dtype=torch.long), responses=torch.ones(1, 1, dtype=torch.long),
            response_mask=torch.ones(1, 1, dtype=torch.long), group_ids=torch.zeros(1, dtype=torch.long),
            prompt_length=1, images=[[]], prompts=["p"], ground_truths=[None], extras=[{}],
        )  # fmt: skip


def run_engine(config: Any, training: bool, discarded: bool = False) -> list[Any]:
    from vlrl.workers.engine_side import EngineSide
    from vlrl.workers.rank_worker import RankWorker
    from vlrl.workers.training_side import TrainingSide

    rollout = SimpleNamespace(tensor_parallel_size=1, max_staleness=1)
    config = SimpleNamespace(**vars(config), worker=SimpleNamespace(rollout=rollout))
    worker = RankWorker.__new__(RankWorker)
    worker.clock = BusyClock()
    engine = RecordingEngine(discarded)
    worker.role, worker.config, worker.device, worker.rank = "hybrid", config, torch.device("cpu"), 0
    worker.engine_side = EngineSide(config, 0, engine, None, None, lambda batch: None, False)  # type: ignore[arg-type]
    actor = SimpleNamespace(
        offload_to_cpu=lambda: engine.calls.append("offload"),
        load_to_device=lambda: engine.calls.append("load"),
    )
    worker.training = TrainingSide(config, 0, actor, None, 0, lambda b: None, lambda: None)  # type: ignore[arg-type]

    def sync_weights() -> dict[str, float]:
        engine.calls.append("sync")
        return {}

    worker.sync_weights = sync_weights  # type: ignore[method-assign]
    with worker._room_for_engine(training):
        for _ in engine.generate_stream(SimpleNamespace(), None):
            pass
    return engine.calls


def test_rank_worker_discards_the_weights_only_before_the_updates_sync() -> None:
    assert run_engine(step_config(), training=True) == [
        "offload", "wake_up", "generate", ("sleep", True), "load"
    ]  # fmt: skip
    assert ("sleep", False) in run_engine(step_config(), training=False)  # validation
    assert ("sleep", False) in run_engine(step_config(filtering=True), training=True)
    assert ("sleep", False) in run_engine(step_config(estimator="remax"), training=True)


def test_rank_worker_resyncs_an_engine_that_discarded_its_weights() -> None:
    """A generation the prediction missed: the actor still holds the weights the engine dropped."""
    assert run_engine(step_config(), training=False, discarded=True)[:2] == ["sync", "offload"]


# ---------------------------------------------------------------------------- engine log-probs
def test_other_log_prob_modes_are_refused() -> None:
    vllm_settings.check_logprobs_mode("processed_logprobs")
    for mode in ("raw_logprobs", "processed_logits"):
        with pytest.raises(RuntimeError, match="not be those of the distribution it samples from"):
            vllm_settings.check_logprobs_mode(mode)


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (["worker.rollout.top_k=20"], True),
        (["worker.rollout.top_p=0.7"], True),  # below 1 - clip_ratio_low = 0.8
        (["worker.rollout.top_p=0.9"], False),  # the ratio starts in [0.9, 1]: inside the clip
        (["worker.rollout.top_p=0.7", "worker.actor.clip_ratio_low=0.4"], False),
        ([], False),
    ],
)
def test_old_policy_rollout_with_truncation(base: list[str], overrides: list[str], refused: bool) -> None:
    args = [*base, "algorithm.old_policy=rollout", *overrides]
    if not refused:
        assert load_config(args).algorithm.old_policy == "rollout"
        return
    with pytest.raises(ConfigError, match="the PPO ratio starts at the kept probability mass"):
        load_config(args)


def test_truncation_with_the_actors_ratio_or_tis_is_allowed(base: list[str]) -> None:
    assert load_config([*base, "worker.rollout.top_k=20"]).algorithm.old_policy == "actor"
    assert load_config([*base, "worker.rollout.top_k=20", "algorithm.tis_cap=2"]).algorithm.tis_cap == 2
