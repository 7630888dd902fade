"""End to end through the real CLI: Ray, rank workers with vLLM SPMD engines, FSDP2 actors, rewards.

Each run is a subprocess (`python -m vlrl.trainer.main ...`), as a user would start it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from e2e_helpers import build_assets, cli_args, read_metrics, run_cli, safe_metrics, start_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_assets(tmp_path_factory.mktemp("e2e"))


def test_two_ranks_train_checkpoint_and_a_killed_run_resumes_exactly(
    assets: dict[str, Path], tmp_path: Path
) -> None:
    """Two ranks (data parallel, KL loss with a reference and a k3 bound through the CLI, two updates
    per step, sequence-level masked IS), 4 steps with
    checkpoints at 2 and 4 and validation at the end; then the same run killed during step 3 and
    started again resumes from step 2 and logs what the uninterrupted run logged."""
    common = ["trainer.n_gpus_per_node=2", "algorithm.disable_kl=false", "algorithm.use_kl_loss=true",
              "algorithm.kl_penalty=low_var_kl", "trainer.save_freq=2", "trainer.val_before_train=false",
              "trainer.val_freq=-1", "trainer.max_steps=4", "worker.rollout.calculate_log_probs=true",
              "algorithm.off_policy_correction=seq_mask", "algorithm.correction_bound=1.5",
              # a k3 bound the tiny model's KL passes once the policy moves: the key reaches both ranks
              "algorithm.low_var_kl_clamp=1e-4"]  # fmt: skip
    reference = tmp_path / "uninterrupted"
    run_cli(cli_args(assets, reference, *common))
    expected = read_metrics(reference)
    assert sorted(expected) == [1, 2, 3, 4]
    for row in expected.values():
        assert 0.0 <= row["reward/overall"] <= 1.0
        assert row["actor/grad_norm"] > 0  # the update reached the weights
        assert "actor/kl_loss" in row and row["timing/gen"] > 0 and row["timing/update"] > 0
        assert row["perf/tokens_per_s"] > 0
        assert row["rollout/log_prob_diff_mean"] < 0.05  # the old log-probs vs the engine's
        # synchronous: the engine samples the actor's weights, every sequence stays in the band
        assert row["off_policy/masked_frac"] == 0.0 and row["off_policy/weight_mean"] == 1.0
    assert expected[1]["actor/kl_clamped_share"] < expected[4]["actor/kl_clamped_share"] <= 1.0
    assert expected[4]["actor/kl_clamped_share"] > 0.0
    assert "val/overall" in expected[4]  # validation at the end
    tracker = json.loads((reference / "checkpoint_tracker.json").read_text())
    assert tracker["latest"] == 4
    _check_merged_weights_changed(reference / "global_step_4" / "actor", assets["model"])

    killed = tmp_path / "killed"
    proc = start_cli(cli_args(assets, killed, *common), tmp_path / "killed.log")
    deadline = time.time() + 600
    # wait until step 2 is checkpointed and logged, then kill during step 3
    while time.time() < deadline and proc.poll() is None:
        if (killed / "global_step_2" / "trainer_state.json").exists() and 2 in safe_metrics(killed):
            break
        time.sleep(0.2)
    time.sleep(0.5)
    assert proc.poll() is None, (
        "the run ended before it could be killed:\n" + (tmp_path / "killed.log").read_text()[-3000:]
    )
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before_kill = max(safe_metrics(killed))
    assert done_before_kill < 4

    timeline = tmp_path / "timeline.json"
    proc = run_cli(cli_args(assets, killed, *common, f"trainer.ray_timeline={timeline}"))
    assert "resumed from" in proc.stdout + proc.stderr
    resumed = read_metrics(killed)
    assert sorted(resumed) == [1, 2, 3, 4]
    keys = ["reward/overall", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm",
            "critic/score/mean", "actor/kl_clamped_share"]  # fmt: skip
    for step in range(done_before_kill + 1, 5):
        for key in keys + (["val/overall"] if step == 4 else []):
            assert resumed[step][key] == pytest.approx(expected[step][key], rel=1e-4, abs=1e-6), (step, key)
    events = json.loads(timeline.read_text())  # Ray's task timeline (Chrome trace events)
    assert any("generate" in str(event.get("name", "")) for event in events), events[:3]


def _check_merged_weights_changed(actor_dir: Path, initial: Path) -> None:
    """The checkpoint merges into a folder transformers loads, and training moved the weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from vlrl.tools.model_merger import merge

    merged = Path(merge(str(actor_dir)))
    model = AutoModelForImageTextToText.from_pretrained(merged)
    before = load_file(initial / "model.safetensors")
    after = load_file(merged / "model.safetensors")
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert "lm_head.weight" in changed and len(changed) > len(before) // 2
    assert model.config.architectures == ["Qwen2_5_VLForConditionalGeneration"]


def test_partial_rollouts_take_the_weights_inside_a_generation(
    assets: dict[str, Path], tmp_path: Path
) -> None:
    """Staleness 2 with partial rollouts on two rollout ranks (each takes a sync at its own engine
    step; the broadcast completes when both have), each engine serving one request at a time (64
    tokens each, EOS ignored), so that generating is far slower than training and a generation is
    running when a sync comes. One request at a time also means a group's later samples start
    after the switch while its first one encoded the image before it: the engine must keep that
    embedding (vLLM has no pixels left to encode it again; resetting its encoder cache there failed
    the next sample). Steps 1 and 2 submit the generations of steps 2-3 and 4, each queued behind the
    one running; the sync of step 2 (update 1) is queued behind the generation of step 3, and so
    without partial rollouts step 3 would train on tokens of update 0 only (staleness 2, as in
    `test_async_mode_trains_off_policy_and_resumes_exactly`). With them, that generation takes
    update 1 between two of its engine steps, so its tokens are fresher; likewise step 4's with
    update 2. Step 5's generation was submitted after the last sync (no step after it to submit),
    so it is two updates old. Where the switch lands inside a generation (before its first token,
    or a few rows in) depends on timing; a fixed switch is checked token by token in
    tests/rollout/test_vllm_engine.py."""
    steps = 5
    run_cli(cli_args(
        assets, tmp_path, "trainer.n_gpus_per_node=3", "worker.rollout.async_ranks=2",
        "worker.rollout.max_staleness=2", "worker.rollout.partial_rollouts=true", f"trainer.max_steps={steps}",
        "trainer.val_before_train=false", "trainer.val_freq=-1", "data.val_files=''", "trainer.save_freq=-1",
        "data.max_response_length=64", "worker.rollout.ignore_eos=true", "worker.rollout.max_num_seqs=1",
    ))  # fmt: skip
    metrics = read_metrics(tmp_path)
    assert sorted(metrics) == list(range(1, steps + 1))
    assert [metrics[s]["async/staleness"] for s in metrics] == [0, 1, 2, 2, 2]
    for s, m in metrics.items():
        fresh = m["async/token_staleness_mean"]
        assert 0 <= fresh <= m["async/token_staleness_max"] <= m["async/staleness"], (s, m)
        if s in (3, 4):
            assert 1 <= fresh < 2 and m["async/token_staleness_max"] >= 1, (s, m)
            if m["async/tokens_newer_frac"] > 0:  # the switch came after the first rows started
                assert 0 < m["async/rows_updated_frac"] < 1 and m["async/token_staleness_max"] == 2
        if s > 1:
            assert 0 <= m["ranks/train_idle_share"] <= 1 and 0 <= m["ranks/rollout_idle_share"] <= 1
    assert metrics[5]["async/token_staleness_mean"] == 2


@pytest.mark.parametrize("ratio_from, staleness", [("rollout", 1), ("actor", 1), ("rollout", 2)])
def test_async_mode_trains_off_policy_and_resumes_exactly(
    assets: dict[str, Path], tmp_path: Path, ratio_from: str, staleness: int
) -> None:
    """One step off (the default: the PPO ratio from the policy that sampled; with truncated
    importance sampling, from the actor), and two steps off (the weights broadcast in the
    background while a generation runs; prompts drawn by pass rate while two batches are in
    flight, within a curriculum by pass rate); the ratio from the sampler also resumes exactly,
    prompt statistics included."""
    # one training rank, one rollout rank; the checkpoint at step 2 holds the generations of the
    # steps after it that were submitted (step 3; with staleness 2, steps 3 and 4)
    steps = 2 + staleness
    common = ["trainer.n_gpus_per_node=2", "worker.rollout.async_ranks=1", "trainer.save_freq=2",
              "trainer.val_before_train=false", "trainer.val_freq=-1", "data.val_files=''",
              f"trainer.max_steps={steps}", f"worker.rollout.max_staleness={staleness}"]  # fmt: skip
    if ratio_from == "actor":
        common.append("algorithm.tis_cap=2.0")  # then algorithm.old_policy=auto is actor
    if staleness == 2:  # the pass-rate sampler within a pass-rate curriculum's pool
        common += ["data.sampler=pass_rate", "data.curriculum=pass_rate", "data.curriculum_steps=2"]
    full = tmp_path / "full"
    proc = run_cli(cli_args(assets, full, *common, "print_config=true"))
    assert f"algorithm.old_policy = {ratio_from!r}" in proc.stdout
    run_cli(cli_args(assets, full, *common))
    expected = read_metrics(full)
    # step 1 generated at once; then each step's batch was submitted `staleness` steps earlier
    # (step 2 at step 1, with the weights of update 0)
    lag = {1: [0.0, 1.0, 1.0], 2: [0.0, 1.0, 2.0, 2.0]}[staleness]
    assert [expected[s]["async/staleness"] for s in range(1, steps + 1)] == lag
    # every token is labelled with the version that sampled it: whole generations, one version each
    for s in range(1, steps + 1):
        assert expected[s]["async/token_staleness_mean"] == expected[s]["async/staleness"], s
        assert expected[s]["async/tokens_newer_frac"] == 0.0, s
    # step 1 samples with the broadcast initial weights: engine and actor agree
    assert expected[1]["rollout/log_prob_diff_mean"] < 0.05
    assert (full / "global_step_2" / "prefetched.pt").is_file()
    if ratio_from == "actor":
        assert all(0 < expected[s]["off_policy/weight_mean"] <= 2.0 for s in (1, 2, 3))
        return

    resumed = tmp_path / "resumed"
    proc = run_cli(
        cli_args(assets, resumed, *common, f"trainer.load_checkpoint_path={full / 'global_step_2'}")
    )
    assert "resumed from" in proc.stdout + proc.stderr
    again = read_metrics(resumed)
    assert sorted(again) == list(range(3, steps + 1))
    for step in again:
        for key in ("reward/overall", "response_length/mean", "actor/pg_loss", "actor/grad_norm",
                    "rollout/log_prob_diff_mean", "async/staleness", "prompts/seen_share",
                    "prompts/pass_rate_mean", "prompts/level_pass_rate"):  # fmt: skip
            assert again[step][key] == pytest.approx(expected[step][key], rel=1e-6, abs=1e-9), (step, key)
