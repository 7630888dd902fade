"""Ulysses sequence parallelism is exact: ulysses_size=2 gives the log-probs and every parameter's
gradient of ulysses_size=1 on the same batch (2 gloo ranks on CPU, fp32; see ulysses_job.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from actor_helpers import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ARCHS = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe")


@pytest.fixture(scope="module", params=ARCHS)
def job(request, actor_model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import ulysses_job

    out = tmp_path_factory.mktemp(f"ulysses_{request.param}")
    launch(ulysses_job.run, 2, actor_model(request.param), str(out))
    return torch.load(Path(out) / "rank0.pt", weights_only=False)


def test_the_batch_splits_images_across_ranks(job):
    # an image's tokens on both ranks, and micro-batches whose images are on one rank only
    assert job["image_splits"]["straddling"] >= 1, job["image_splits"]
    assert job["image_splits"]["one_sided"] >= 1, job["image_splits"]


def test_attention_exchange_with_repeated_kv_heads(job):
    assert job["attention_kv_repeat_err/rank0"] < 1e-6


def test_log_probs_equal(job):
    assert job["log_prob_err"] < 1e-5
    assert job["ref_log_prob_err"] < 1e-5
    assert job["ref_vs_actor_err"] < 1e-5  # the untouched reference scores like the actor


def test_every_gradient_equals(job):
    keys = [k for k in job if k.startswith("grad_err/")]
    assert len(keys) == 4
    for key in keys:
        assert job[key.replace("grad_err", "grad_keys_match")], key
        assert job[key] < 1e-5, (key, job[key])


def test_gradient_checkpointing_and_empty_micro_batches(job):
    assert job["checkpointed_grad_err"] < 1e-5
    # the anchors reach every parameter (the vision tower's too) ...
    assert job["empty_grad_count"] == job["num_params"]
    assert job["empty_grad_max"] == 0.0  # ... with exactly zero gradient


def test_update_metrics_and_weights_equal(job):
    one, two = job["metrics"]
    for name in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-7), name
    assert job["weights_moved"] > 1e-4
    # Adam's first step is lr * g / (|g| + 1e-8): entries whose gradient is at rounding level
    # (~1e-8) may move differently by a fraction of lr (1e-3); everything else moves the same
    assert job["weights_err"] < 5e-5
