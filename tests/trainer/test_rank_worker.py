"""RankWorker phases: the actor leaves the GPU around generation (worker.actor.offload)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from vlrl.batch.held import Holdings
from vlrl.batch.rows import FinishedGroups, KeptRows, RolloutBatch
from vlrl.batch.samples import StepSamples
from vlrl.config import PPOConfig
from vlrl.utils.busy_clock import BusyClock
from vlrl.workers.engine_side import EngineSide
from vlrl.workers.rank_worker import RankWorker
from vlrl.workers.training_side import TrainingSide

GROUPS = FinishedGroups(prompt_rows=[0], responses=[[7]])


def _rollout(n: int = 1, engine: torch.Tensor | None = None, old: torch.Tensor | None = None) -> RolloutBatch:
    return RolloutBatch(
        input_ids=torch.ones(n, 3, dtype=torch.long), attention_mask=torch.ones(n, 3, dtype=torch.long),
        position_ids=torch.arange(3).repeat(n, 1), responses=torch.ones(n, 2, dtype=torch.long),
        response_mask=torch.ones(n, 2, dtype=torch.long), group_ids=torch.arange(n), prompt_length=1,
        images=[[]] * n, prompts=["p"] * n, ground_truths=[None] * n, extras=[{}] * n,
        rollout_log_probs=engine, old_log_probs=old,
    )  # fmt: skip


BATCH = _rollout()  # the engine's rows of the shard


def _is_batch(item: object) -> bool:
    """The samples a generating rank reports for BATCH, which it keeps (published) itself."""
    return isinstance(item, StepSamples) and item.held[0] is not None and item.held[0][0].fetch() is BATCH


class _Recorder:
    """Fake actor / engine: records the calls the worker makes, in order."""

    weights_discarded = False  # an engine's state, not a call (a level-2 sleep would set it)

    def __init__(self, calls: list[str], name: str, fail_on: str | None = None) -> None:
        self.calls, self.name, self.fail_on = calls, name, fail_on

    def __getattr__(self, method: str):
        def record(*args, **kwargs):
            self.calls.append(f"{self.name}.{method}")
            if method == self.fail_on:
                raise RuntimeError("engine failed")
            return iter([GROUPS, BATCH]) if method == "generate_stream" else None

        return record


def _worker(
    calls: list[str], device: str, fail_on: str | None = None, rank: int = 0, tp: int = 1
) -> RankWorker:
    """A hybrid rank (both sides) around recording fakes; no process group needed for these phases."""
    worker = RankWorker.__new__(RankWorker)
    worker.device = torch.device(device)
    worker.role, worker.image_refs, worker.rank = "hybrid", None, rank
    worker.clock = BusyClock()
    worker.config = PPOConfig()  # the defaults: one generation round, so the update's sync follows it
    worker.config.worker.rollout.tensor_parallel_size = tp
    engine = _Recorder(calls, "rollout", fail_on)
    worker.engine_side = EngineSide(
        worker.config, rank, engine, None, None, lambda batch: None, rollout_only=False
    )
    worker.training = TrainingSide(worker.config, rank, _Recorder(calls, "actor"), None, 0, lambda batch: None,
                                   lambda: None)  # fmt: skip
    return worker


def test_actor_offloads_before_the_engine_wakes_and_returns_after(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    assert _is_batch(_worker(calls, "cuda").generate(prompts=SimpleNamespace(images=[]), keep_for=1))
    assert calls == [
        "actor.offload_to_cpu",
        "empty_cache",
        "rollout.wake_up",
        "rollout.generate_stream",
        "rollout.sleep",
        "actor.load_to_device",
    ]


class _Scoring:
    """Fake `RankScoring`: records when groups arrive and when the batch is finished."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def add_groups(self, groups: FinishedGroups) -> None:
        self.calls.append(f"score groups {groups.prompt_rows}")

    def finish(self, batch: RolloutBatch):
        self.calls.append("score the rest")
        return SimpleNamespace(scores=[{"overall": 1.0}] * len(batch), failures=2), 0.5

    def abort(self) -> None:
        self.calls.append("abort scoring")


def _scoring_worker(calls: list[str], **kwargs) -> RankWorker:
    worker = _worker(calls, "cpu", **kwargs)
    worker.engine_side._scoring = lambda prompts: _Scoring(calls)
    return worker


def test_streamed_groups_are_scored_while_the_actor_is_away_and_the_rest_after() -> None:
    calls: list[str] = []
    samples = _scoring_worker(calls).generate(prompts=SimpleNamespace(images=[]), keep_for=1, score=True)
    assert calls.index("score groups [0]") < calls.index("rollout.sleep")  # during generation
    assert calls[-2:] == ["actor.load_to_device", "score the rest"]  # the actor is back first
    assert _is_batch(samples) and samples.reward_parts == [{"overall": 1.0}]
    assert (samples.reward_failures, samples.reward_wait_s) == (2, 0.5)
    assert samples.responses is not None  # responses_back defaults to true
    kept = _scoring_worker([]).generate(prompts=SimpleNamespace(images=[]), score=True, responses_back=False)
    assert kept.responses is None and kept.reward_parts == [{"overall": 1.0}]


def test_only_the_first_rank_of_a_tensor_parallel_group_returns_and_scores_rollouts() -> None:
    """Its peers ran the same engine on the same prompts: they send no copy of the rows through
    the driver, and score nothing."""
    for rank in range(4):
        calls: list[str] = []
        samples = _scoring_worker(calls, rank=rank, tp=2).generate(
            prompts=SimpleNamespace(images=[]), keep_for=1, score=True
        )
        if rank % 2 == 0:
            assert _is_batch(samples) and "score the rest" in calls, rank
        else:
            assert samples is None and not [c for c in calls if c.startswith("score")], rank


def test_no_cuda_cache_release_on_cpu(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    _worker(calls, "cpu").generate(prompts=SimpleNamespace(images=[]), keep_for=1)
    assert "empty_cache" not in calls and calls[0] == "actor.offload_to_cpu"


def test_actor_comes_back_and_scoring_stops_when_generation_fails() -> None:
    calls: list[str] = []
    with pytest.raises(RuntimeError, match="engine failed"):
        _scoring_worker(calls, fail_on="generate_stream").generate(
            prompts=SimpleNamespace(images=[]), keep_for=1, score=True
        )
    assert calls[-2:] == ["actor.load_to_device", "abort scoring"]


def test_gpu_process_group_has_a_cpu_backend_for_fsdp_cpu_offload() -> None:
    """Collectives on CPU tensors (FSDP CPU offload) need a CPU backend in the default group."""
    from torch.distributed.distributed_c10d import BackendConfig

    from vlrl.workers.rank_worker import process_group_backend

    plain = BackendConfig("nccl").get_device_backend_map()
    assert "cpu" not in plain  # what the old backend string gave: CPU tensor collectives fail
    ours = BackendConfig(process_group_backend("cuda")).get_device_backend_map()
    assert ours == {"cuda": "nccl", "cpu": "gloo"}
    assert process_group_backend("cpu") == "gloo"


def test_update_reads_the_kept_rows_in_the_drivers_order_and_spreads_per_row_advantages() -> None:
    side = _worker([], "cpu").training
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    side.kept_rows = [7, 3]  # the step's row ids of the kept shard, in its order
    side.kept = RolloutBatch(
        input_ids=torch.arange(10).view(2, 5), attention_mask=torch.ones(2, 5, dtype=torch.long),
        position_ids=torch.arange(5).repeat(2, 1), responses=torch.tensor([[7, 8, 0], [9, 0, 0]]),
        response_mask=mask, group_ids=torch.tensor([0, 1]), prompt_length=2, images=[[], []],
        prompts=["a", "b"], ground_truths=[1, 2], extras=[{}, {}],
    )  # fmt: skip
    batch = side._kept_batch(KeptRows([3, 7], {}, per_row={"advantages": torch.tensor([-0.5, 2.0])}))
    assert batch.prompts == ["b", "a"] and batch.prompt_length == 2
    assert batch.advantages.tolist() == [[-0.5, 0.0, 0.0], [2.0, 2.0, 0.0]]
    assert batch.ref_log_probs is None  # never computed: still None
    with pytest.raises(RuntimeError, match=r"names rows \[5\] that this step's take_rows did not keep"):
        side._kept_batch(KeptRows([3, 5], {"advantages": torch.zeros(2, 3)}))


@pytest.mark.parametrize("old_policy", ["actor", "rollout"])
def test_the_update_measures_the_ratio_from_the_configured_old_policy(old_policy: str) -> None:
    """algorithm.old_policy=rollout: the engine's log-probs (the policy that sampled) are the old ones."""
    seen = {}

    class Actor:
        def update_policy(self, batch: RolloutBatch, on_policy: bool) -> dict[str, float]:
            seen["old"] = batch.old_log_probs
            return {}

    worker = _worker([], "cpu")
    worker.role, worker.engine_side = "train", None  # a training rank: no engine to sync into
    algorithm = SimpleNamespace(old_policy=old_policy, tis_cap=None)
    plan = replace(worker.config.plan, old_log_probs="pass", ratio_from=old_policy, correction="none")
    config = SimpleNamespace(worker=worker.config.worker, algorithm=algorithm, plan=plan)
    side = worker.training
    side.config, side.actor = config, Actor()
    actor_old, engine = torch.full((1, 2), -1.0), torch.full((1, 2), -2.0)
    side.kept_rows, side.kept = [0], _rollout(engine=engine, old=actor_old)
    metrics, drift = worker.update(KeptRows([0], {}, per_row={"advantages": torch.ones(1)}))
    assert set(metrics) == {"clock/busy_s", "clock/wall_s"}  # the rank's busy clock, for the driver
    assert drift == {"mean": 1.0, "max": 1.0, "tokens": 2.0}  # engine vs actor, either way
    assert torch.equal(seen["old"], engine if old_policy == "rollout" else actor_old)


def test_a_rank_holds_what_it_published_until_it_generates_for_a_later_step() -> None:
    """Its own reference keeps a published batch alive while the driver and the other ranks pass
    references to it along (a hybrid rank's rows are taken within their step; a rollout rank's
    up to `max_staleness` steps later, while it already generates the ones after)."""
    worker = _worker([], "cpu")
    first = worker.generate(prompts=SimpleNamespace(images=[]), keep_for=1)
    second = worker.generate(prompts=SimpleNamespace(images=[]), keep_for=1)  # a second round of step 1
    holdings = worker.engine_side.holdings
    assert [s for s, _ in holdings.published] == [1, 1]
    assert first is not None and second is not None and first.held[0][0] is holdings.published[0][1]
    worker.generate(prompts=SimpleNamespace(images=[]))  # validation: nothing published or dropped
    worker.generate(prompts=SimpleNamespace(images=[]), keep_for=2)
    assert [s for s, _ in holdings.published] == [2]
    worker.engine_side.holdings = holdings = Holdings(
        1
    )  # a rollout rank, one step ahead: step 2's rows are taken during step 3
    worker.generate(prompts=SimpleNamespace(images=[]), keep_for=2)
    worker.generate(prompts=SimpleNamespace(images=[]), keep_for=3)
    assert [s for s, _ in holdings.published] == [2, 3]
    worker.engine_side.holdings = holdings = Holdings(
        2
    )  # two steps ahead: step s's rows are taken during step s + 2
    for step in (3, 4, 5):
        worker.generate(prompts=SimpleNamespace(images=[]), keep_for=step)
    assert [s for s, _ in holdings.published] == [3, 4, 5]
    worker.generate(prompts=SimpleNamespace(images=[]), keep_for=6)
    assert [s for s, _ in holdings.published] == [4, 5, 6]
