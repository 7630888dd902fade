"""Two gloo ranks on CPU (spawned once, all checks in one job: see actor_multirank_job.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from actor_helpers import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def job(actor_model, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import actor_multirank_job

    out = tmp_path_factory.mktemp("multirank")
    launch(actor_multirank_job.run, 2, actor_model("qwen2_5_vl"), str(out))
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_weights_broadcast_from_rank0(job):
    assert all(r["broadcast_err"] == 0.0 for r in job)


@pytest.mark.parametrize("mode", ["token", "seq", "seq-mean-token-sum", "token-dynamic"])
def test_two_ranks_micro_batches_equal_full_batch_gradient(job, mode):
    assert job[0][f"grad_keys_match/{mode}"]
    assert job[0][f"grad_err/{mode}"] < 1e-5
    assert job[0][f"grad_norm_err/{mode}"] < 1e-5  # the global norm, reduced over ranks
    assert job[0][f"torch_clip_norm_err/{mode}"] < 1e-5  # torch's clip_grad_norm_ agrees on DTensors


def test_mixed_image_and_text_ranks_do_not_hang(job):
    for r in job:
        assert r["mixed_logp_err"] < 1e-4  # the dummy image on the text rank changes nothing
        assert r["mixed_update"]["actor/skipped_steps"] == 0


def test_training_lowers_the_loss(job):
    losses = job[0]["losses"]
    assert losses[-1] < losses[0] - 0.05, losses


def test_checkpoint_round_trip_is_exact(job):
    for r in job:
        assert r["ckpt_moved"] > 0  # the step after saving changed the weights
        assert r["ckpt_weights_err"] == 0.0
        assert r["ckpt_optim_err"] == 0.0
        assert r["ckpt_resume_err"] == 0.0
        assert r["ckpt_lr"][0] == r["ckpt_lr"][1]


def test_non_finite_step_is_skipped_on_every_rank(job):
    for r in job:
        assert r["nonfinite_skipped"] == 1.0
        assert r["nonfinite_weights_err"] == 0.0
        assert r["nonfinite_total"] == 1
        assert r["after_skip_update"] == 0.0  # training goes on


def test_frozen_vision_tower_is_unchanged(job):
    for r in job:
        assert r["frozen_num_vision"] > 0
        assert r["frozen_vision_err"] == 0.0
        assert r["frozen_text_moved"] > 0


def test_save_hf_writes_full_weights(job):
    assert job[0]["hf_num_tensors"] > 0
