"""The trainer's logic without Ray: `PPOTrainer` over one real `RankWorker` in this process.

Real parts throughout (tiny Qwen2.5-VL, FSDP2 actor on a gloo world of one, the HF rollout
engine, reward worker processes); only Ray is left out, through `InProcessRanks`. Each test
checks a piece of the driver's bookkeeping against a value computed by hand from what the step
logged or returned.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from vlrl.config.loader import load_config
from vlrl.rewards import RewardRunner
from vlrl.trainer.data_setup import TrainingData
from vlrl.trainer.metrics import PhaseTimer
from vlrl.trainer.ppo_trainer import PPOTrainer
from vlrl.trainer.ranks import InProcessRanks

REPO = Path(__file__).resolve().parents[2]

# overall = 1 for the colours in SOLVED (a group of such prompts has all-equal rewards and online
# filtering drops it), else the share of vowels in the response (varies between samples).
# `calls` counts the samples of the call that scored a sample. The function scores each sample
# on its own (PARTIAL_BATCHES), except where a test says otherwise.
REWARD = """
SOLVED = {solved}
PARTIAL_BATCHES = {partial}
def compute_score(inputs):
    return [{{'overall': 1.0 if x.ground_truth in SOLVED else
              sum(c in 'aeiou' for c in x.response) / max(len(x.response), 1),
              'calls': float(len(inputs))}} for x in inputs]
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vlrl.data.synthetic import make_shapes_dataset
    from vlrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("ppo_trainer")
    model = build_tiny_model(root / "model", arch="qwen2_5_vl", seed=0, min_pixels=3136, max_pixels=3136)
    train, val = make_shapes_dataset(root / "data", n_train=48, n_val=4, seed=0, task="colour")
    return {"root": root, "model": model, "train": Path(train), "val": Path(val)}


def _trainer(
    assets: dict[str, Path], tmp_path: Path, *overrides: str, solved: str = "set()", partial: bool = True
) -> PPOTrainer:
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD.format(solved=solved, partial=partial))
    config = load_config([
        f"config={REPO / 'examples' / 'quickstart.yaml'}",
        f"worker.actor.model.model_path={assets['model']}",
        f"data.train_files={assets['train']}", "data.val_files=",
        f"data.format_prompt={REPO / 'format_prompts' / 'shapes.jinja'}",
        "data.min_pixels=3136", "data.max_pixels=3136", "data.max_response_length=6",
        "data.rollout_batch_size=4", "worker.actor.global_batch_size=2", "worker.rollout.n=4",
        "worker.actor.micro_batch_size_per_device_for_update=4",
        "worker.rollout.name=hf", "worker.reward.reward_type=batch",
        f"worker.reward.reward_function={reward}:compute_score",
        f"trainer.save_checkpoint_path={tmp_path / 'run'}", "trainer.max_steps=2",
        "trainer.logger=[file]", "trainer.plot_path=null",
        *overrides,
    ])  # fmt: skip
    return PPOTrainer(
        config,
        TrainingData(config),
        RewardRunner(config.worker.reward),
        lambda: InProcessRanks.single_rank(config).roles(),
    )


@pytest.fixture
def make(assets: dict[str, Path], tmp_path: Path):
    """`make(*overrides, solved=..., partial=...)` -> a set-up trainer, closed after the test."""
    # An engine left by an earlier test module may tear its torch.distributed world down whenever
    # it is garbage-collected, i.e. in the middle of this trainer's set-up: collect it now.
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # An earlier vLLM trainer's world group, whose process groups its shutdown destroyed: a new
    # engine would take it for its own.
    import vllm.distributed.parallel_state as vllm_groups

    vllm_groups._WORLD = None
    made: list[PPOTrainer] = []

    def build(*overrides: str, solved: str = "set()", partial: bool = True) -> PPOTrainer:
        for earlier in made:  # one run folder: an earlier trainer's run is over, so is its lock
            earlier.checkpoints.close()
        made.append(_trainer(assets, tmp_path, *overrides, solved=solved, partial=partial))
        return made[-1]

    yield build
    for trainer in made:
        trainer.close()


class _CountingData:
    """Counts the loader batches the trainer draws (one per generation round)."""

    def __init__(self, data: TrainingData) -> None:
        self.data, self.batches = data, 0

    def __getattr__(self, name: str):
        return getattr(self.data, name)

    def next_train_batch(self):
        self.batches += 1
        return self.data.next_train_batch()


def test_the_start_up_line_says_where_the_time_went(make, capsys) -> None:
    make()
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[vlrl] start-up ")]
    assert len(line) == 1, line
    # the trainer's own phase (this test starts no Ray), then rank 0's phases (RankWorker.setup;
    # it waits for the reward workers it started when it scores its own rows)
    seconds = r"\d+\.\d s"
    pattern = rf"start-up {seconds}: models {seconds} \(rank 0's models: processor {seconds}, engine {seconds}, actor {seconds}, weight_sync {seconds}(, reward_workers_wait {seconds})?\)$"
    assert re.search(pattern, line[0]), line[0]


def test_online_filtering_refills_the_batch_with_unsolved_groups(make) -> None:
    trainer = make(
        "algorithm.online_filtering=true", "algorithm.filter_key=overall", "data.mini_rollout_batch_size=2",
        solved="{'red', 'green'}",
    )  # fmt: skip
    trainer.data = counting = _CountingData(trainer.data)
    batch, _, metrics = trainer._generate_scored_batch(PhaseTimer())
    groups = batch.group_ids.tolist()
    assert len(batch) == 16 and len(set(groups)) == 4  # rollout_batch_size groups of n, excess cut
    assert not {"red", "green"} & set(batch.ground_truths)  # every solved group was dropped
    assert metrics["filter/tries"] == counting.batches >= 2  # ~half the prompts are solved
    for g in set(groups):  # kept groups have a reward spread (the filter's bounds are 0.01, 0.99)
        overall = [p["overall"] for p, gid in zip(batch.scored_parts(), groups) if gid == g]
        assert max(overall) > min(overall) or 0.01 < overall[0] < 0.99
    # the rows stay where the rounds published them; taken back, they are the kept samples, in order
    assert len({id(held) for held, _ in batch.held}) >= 2  # rows of more than one round
    rows = trainer._rows_of(batch)
    assert batch.responses is None  # the rank scored them: no ids reached the driver
    assert rows.ground_truths == batch.ground_truths and torch.equal(
        rows.group_ids % (1 << 40), batch.group_ids % (1 << 40)
    )
    assert torch.equal(rows.response_mask, batch.response_mask)  # both at the step's width
    assert torch.equal(rows.attention_mask.sum(-1), batch.sequence_lengths)


def test_too_many_filtered_rounds_is_an_error(make) -> None:
    trainer = make(
        "algorithm.online_filtering=true", "algorithm.filter_key=overall", "trainer.max_try_make_batch=2",
        solved="{'red', 'green', 'blue', 'yellow'}",
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="kept 0 of 4 groups after 2 generation rounds"):
        trainer._generate_scored_batch(PhaseTimer())


def test_remax_baseline_is_the_greedy_response_reward(make) -> None:
    # Sampling from the top token only (top_k=1) gives the greedy response: each reward equals its baseline.
    trainer = make("algorithm.adv_estimator=remax", "worker.rollout.top_k=1", "worker.rollout.n=2")
    batch, baselines, _ = trainer._generate_scored_batch(PhaseTimer())
    overall = torch.tensor([p["overall"] for p in batch.scored_parts()])
    assert baselines is not None and baselines.shape == (8,)
    assert torch.equal(baselines, overall) and bool((overall > 0).any())
    for g in set(batch.group_ids.tolist()):  # one baseline per prompt
        assert len(set(baselines[batch.group_ids == g].tolist())) == 1


def test_kl_in_the_reward_follows_the_adaptive_controller(make) -> None:
    trainer = make(
        "algorithm.disable_kl=false", "algorithm.use_kl_loss=false", "algorithm.kl_type=adaptive",
        "algorithm.kl_coef=0.1", "algorithm.kl_target=0.01", "algorithm.kl_horizon=100",
        "worker.actor.optim.lr=1e-2",
    )  # fmt: skip
    coef = 0.1
    for step in (1, 2):
        trainer.global_step = step
        metrics = trainer.train_step()
        error = min(max(metrics["critic/kl"] / 0.01 - 1.0, -0.2), 0.2)
        coef *= 1.0 + error * 16 / 100  # n_steps = samples of the step
        assert metrics["critic/kl_coef"] == pytest.approx(coef, rel=1e-12)
        if step == 1:  # the actor is the reference before its first update
            assert metrics["critic/kl"] == 0.0
    assert metrics["critic/kl"] > 0.0  # one update later it is not


def test_reinforce_plus_plus_advantages_are_whitened_on_the_rank_with_the_kl_penalty_in(make) -> None:
    """A token-level estimator: the driver sends the rows' scores, the rank computes the returns
    with the KL penalty in them, whitens them over the step and reports their statistics."""
    trainer = make(
        "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.disable_kl=false",
        "algorithm.use_kl_loss=false", "algorithm.kl_coef=0.5", "worker.actor.optim.lr=1e-2",
    )  # fmt: skip
    actor, seen = trainer.ranks.workers[0].actor, []
    update_policy = actor.update_policy
    actor.update_policy = lambda batch, **k: (
        seen.append((batch.advantages, batch.response_mask)),
        update_policy(batch, **k),
    )[1]
    for step in (1, 2):
        trainer.global_step = step
        metrics = trainer.train_step()
    advantages, mask = seen[-1]
    valid = advantages[mask.bool()].double()
    assert abs(valid.mean().item()) < 1e-6 and abs(valid.std(unbiased=False).item() - 1) < 1e-4
    assert bool((advantages[~mask.bool()] == 0).all())
    assert metrics["critic/advantages/mean"] == pytest.approx(valid.mean().item(), abs=1e-9)
    assert (metrics["critic/advantages/max"], metrics["critic/advantages/min"]) == (
        valid.max().item(),
        valid.min().item(),
    )
    assert metrics["critic/kl"] > 0.0 and metrics["training/steps_without_signal"] == 0.0


def test_on_policy_update_skips_the_old_log_prob_pass(make) -> None:
    trainer = make("worker.actor.global_batch_size=4", "worker.actor.ppo_epochs=1")
    assert trainer.config.plan.old_log_probs == "update"
    calls: list[str] = []
    worker = trainer.ranks.workers[0]
    for owner, name in ((worker.actor, "compute_log_probs"), (worker, "take_rows"), (worker, "update")):
        method = getattr(owner, name)
        setattr(owner, name, lambda *a, _m=method, _n=name, **k: (calls.append(_n), _m(*a, **k))[1])
    trainer.global_step = 1
    metrics = trainer.train_step()
    assert calls == [
        "take_rows",
        "update",
    ]  # the rank takes its rows, no old (and, KL off, no reference) pass
    # the update's own log-probs are the old ones: ratio 1, nothing clipped
    assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/pg_clipfrac_higher"] == 0.0
    assert "rollout/log_prob_diff_mean" in metrics  # engine vs the update's old log-probs


def test_the_rank_scores_groups_as_they_finish_and_the_same_batch_as_after_or_on_the_driver(make) -> None:
    """vLLM reports groups as they finish (4 sequences run at a time, so 4 prompts x 4 samples end in
    waves); the generating rank hands each wave to its reward workers at the wave's rows, and the
    scores equal those of scoring after generation, on the rank or on the driver. The driver gets
    no response ids unless it asks."""
    trainer = make("worker.rollout.name=vllm", "worker.rollout.max_num_seqs=4", "data.max_response_length=8")
    rank = trainer.engines.workers[0].engine_side
    rank.rewards = RewardRunner(trainer.config.worker.reward)  # what the rank starts on first use, spied
    adds: list[list[int]] = []
    open_stream = rank.rewards.stream

    def spied_stream():
        stream = open_stream()
        add = stream.add
        stream.add = lambda inputs, rows: (adds.append(list(rows)), add(inputs, rows))[1]
        return stream

    rank.rewards.stream = spied_stream
    trainer.global_step = 1
    prompts = trainer.data.next_train_batch()
    streamed, streamed_metrics = trainer.calls.generate_scored(prompts, 1, responses_back=True)
    assert len(adds) > 1 and sorted(sum(adds, [])) == list(range(16))
    # worker.reward.streaming=false, on the frozen config the in-process rank shares
    object.__setattr__(trainer.config.worker.reward, "streaming", False)
    adds.clear()
    after, after_metrics = trainer.calls.generate_scored(prompts, 1, responses_back=True)
    assert adds == [list(range(16))]  # all at once, after generation
    on_driver = trainer.calls.generate(prompts, 1, responses_back=True)
    on_driver.reward_parts = None  # as rows read from a checkpoint: the driver's reward workers score them
    driver_metrics = trainer.calls.score(on_driver)
    for other in (after, on_driver):
        for name in ("responses", "response_mask", "prompt_lengths", "turn_lengths", "token_level_scores"):
            assert torch.equal(getattr(streamed, name), getattr(other, name)), name
    streamed_rows, after_rows = trainer._rows_of(streamed), trainer._rows_of(after)  # held on the rank
    for name in ("input_ids", "attention_mask", "position_ids", "responses", "rollout_log_probs"):
        assert torch.equal(getattr(streamed_rows, name), getattr(after_rows, name)), name

    def without_calls(values: dict) -> dict:  # the calls' sizes differ by design
        return {key: value for key, value in values.items() if "calls" not in key}

    for other, metrics in ((after, after_metrics), (on_driver, driver_metrics)):
        assert [without_calls(p) for p in streamed.scored_parts()] == [
            without_calls(p) for p in other.scored_parts()
        ]
        assert without_calls(streamed_metrics) == without_calls(metrics)
    assert trainer.calls.generate(prompts, 1).responses is None  # a training step's samples: scores, no ids


def test_a_resumed_run_validates_first_and_val_only_never_trains(
    make, assets: dict[str, Path], tmp_path: Path
) -> None:
    """EasyR1's config finds the last checkpoint: with `val_only` the loaded model is validated and
    nothing is trained or saved; a resumed run validates the loaded model before its next step."""
    import json

    make("trainer.max_steps=1", "trainer.val_before_train=false").fit()
    run = tmp_path / "run"
    assert (run / "global_step_1").is_dir()
    val = (f"data.val_files={assets['val']}", "trainer.find_last_checkpoint=true")
    assert make(*val, "trainer.val_only=true", "trainer.max_steps=2").fit() == []
    assert not (run / "global_step_2").exists()
    make(*val, "trainer.max_steps=2", "trainer.val_freq=-1").fit()
    rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    # the first run's step 1; val_only's validation of step 1; the resumed run: step 1's validation, step 2
    assert [(r["step"], "val/overall" in r, "actor/pg_loss" in r) for r in rows] == [
        (1, False, True), (1, True, False), (1, True, False), (2, True, True),
    ]  # fmt: skip


def test_a_batch_reward_sees_the_whole_batch_unless_it_declares_partial_batches(make) -> None:
    """EasyR1 calls a batch reward with the whole batch (it may normalise across it): streaming and
    several workers must not cut it into groups, unless the file says PARTIAL_BATCHES = True."""
    overrides = ("worker.rollout.name=vllm", "worker.rollout.max_num_seqs=4", "worker.reward.num_workers=2")
    whole = make(*overrides, partial=False)
    whole.global_step = 1
    batch, _ = whole.calls.generate_scored(whole.data.next_train_batch(), 1)
    assert whole.config.worker.reward.streaming and whole.rewards.whole_batches
    assert {parts["calls"] for parts in batch.scored_parts()} == {16.0}  # 4 prompts x 4 samples, one call


def test_pass_rate_sampling_over_mixed_sources_resumes_with_the_same_statistics(
    make, assets: dict[str, Path], tmp_path: Path
) -> None:
    """`data.sampler=pass_rate` with `data.train_weights` over two files: every batch takes 3 : 1
    prompts from them, every round's groups are recorded, and a run resumed from step 2 ends with
    the statistics and data position of one that ran straight through."""
    import json

    rows = assets["train"].read_text().splitlines()
    first, second = assets["train"].parent / "first.jsonl", assets["train"].parent / "second.jsonl"
    first.write_text("\n".join(rows[:36]) + "\n")
    second.write_text("\n".join(rows[36:]) + "\n")
    common = (f"data.train_files=[{first},{second}]", "data.train_weights=[3,1]", "data.sampler=pass_rate",
              "trainer.save_freq=1", "trainer.val_before_train=false")  # fmt: skip
    straight = make(*common, "trainer.max_steps=3", f"trainer.save_checkpoint_path={tmp_path / 'a'}")
    history = straight.fit()
    assert [h["source/first/share"] for h in history] == [0.75] * 3  # 3 of the 4 prompts of each step
    assert {"source/second/reward", "source/first/response_length"} <= set(history[-1])
    stats = straight.data.stats
    assert int(stats.attempts.sum()) == 3 * 4 * 4 and not stats.pending.any()  # steps x prompts x n
    assert history[-1]["prompts/seen_share"] == int((stats.attempts > 0).sum()) / 48
    make(*common, "trainer.max_steps=2", f"trainer.save_checkpoint_path={tmp_path / 'b'}").fit()
    resumed = make(*common, "trainer.max_steps=3", f"trainer.save_checkpoint_path={tmp_path / 'b'}",
                   "trainer.find_last_checkpoint=true")  # fmt: skip
    resumed.fit()
    logged = (tmp_path / "b" / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in logged] == [1, 2, 3]  # step 3 alone after the resume
    saved = [torch.load(tmp_path / run / "global_step_3" / "prompt_stats.pt") for run in ("a", "b")]
    assert all(torch.equal(saved[0][key], saved[1][key]) for key in saved[0])
    assert resumed.data.state_dict() == straight.data.state_dict()


def test_validation_generates_its_image_rows_again_with_blank_and_swapped_images(
    make, assets: dict[str, Path]
) -> None:
    trainer = make(f"data.val_files={assets['val']}", "trainer.val_blind_rows=3")
    calls = []
    generate = trainer.calls.generate_scored

    def spy(prompts, *args, **kwargs):
        calls.append([[image.pixels().tobytes() for image in row] for row in prompts.images])
        return generate(prompts, *args, **kwargs)

    trainer.calls.generate_scored = spy
    metrics = trainer.validate()
    real, blank, swap = calls  # the 4 validation prompts; then the first 3, blanked; then swapped
    assert len(real) == 4 and len({row[0] for row in real}) == 4  # four different images
    assert blank == [[bytes([128]) * len(real[0][0])]] * 3 and swap == real[1:3] + real[:1]
    assert {"val/blind_overall", "val/swapped_overall", "val/blind_gap", "val/swapped_gap"} <= set(metrics)
    assert 0.0 <= metrics["val/blind_overall"] <= 1.0
    calls.clear()
    off = make(f"data.val_files={assets['val']}", "trainer.val_blind_rows=0")
    assert not any(key.startswith("val/blind") for key in off.validate())
