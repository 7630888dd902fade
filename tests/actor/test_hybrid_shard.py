"""Hybrid sharding (`worker.actor.fsdp.fsdp_size` 2 at 4 ranks: a 2 x 2 mesh) against flat sharding:
4 gloo ranks on CPU, spawned once (all checks in one job: see hybrid_shard_job.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from actor_helpers import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REL = 1e-4  # the reductions run in another order (2 + 2 ranks instead of 4): fp32 rounding only


@pytest.fixture(scope="module")
def job(actor_model, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import hybrid_shard_job

    out = tmp_path_factory.mktemp("hybrid")
    launch(hybrid_shard_job.run, 4, actor_model("qwen2_5_vl"), str(out))
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(4)]


def test_parameters_are_replicated_over_dim0_and_sharded_over_dim1(job):
    for r in job:
        assert r["mesh_shapes"] == [(2, 2)]
        assert r["mesh_names"] == [("replicate", "shard")]
        assert r["placements"] == ["(Replicate(), Shard(dim=0))"]


def test_same_losses_grad_norms_and_weights_as_flat(job):
    for r in job:
        assert r["log_prob_err"] < 1e-5
        for key in ("losses", "grad_norms"):
            flat, hybrid = r[f"flat/{key}"], r[f"hybrid/{key}"]
            assert hybrid == pytest.approx(flat, rel=REL, abs=1e-6), key
        assert r["flat/grad_norms"][0] > 0
        assert r["weights_err"] < 1e-5


def test_reference_on_the_2d_mesh_scores_like_the_flat_actor(job):
    for r in job:
        assert r["ref_mesh_shapes"] == [(2, 2)]
        assert r["ref_log_prob_err"] < 1e-5


def test_ulysses_with_hybrid_sharding_matches_flat(job):
    for r in job:
        assert r["ulysses/losses"] == pytest.approx(r["flat/losses"], rel=REL, abs=1e-6)
        assert r["ulysses/grad_norms"] == pytest.approx(r["flat/grad_norms"], rel=REL, abs=1e-6)
        assert r["ulysses/weights_err"] < 1e-5


def test_lora_with_hybrid_sharding_matches_flat(job):
    for r in job:
        for key in ("losses", "grad_norms"):
            assert r[f"lora/hybrid/{key}"] == pytest.approx(r[f"lora/flat/{key}"], rel=REL, abs=1e-6), key
        assert r["lora/flat/grad_norms"][0] > 0
        assert r["lora/merged_keys_match"]
        assert r["lora/merged_err"] < 1e-5


def test_full_state_dict_and_weight_sync_gather_the_full_weights(job):
    assert job[0]["full_state_err"] == 0.0
    assert all(r["full_state_len"] == 0 for r in job[1:])
    assert all(r["sync_err"] == 0.0 for r in job)


def test_a_nan_in_one_replica_is_seen_by_every_rank(job):
    for r in job:
        assert r["finite_before"] is True
        assert r["finite_with_nan"] is False


def test_checkpoint_round_trip_is_exact(job):
    for r in job:
        assert r["ckpt_moved"] > 0
        assert r["ckpt_weights_err"] == 0.0
        assert r["ckpt_optim_err"] == 0.0
        assert r["ckpt_resume_err"] == 0.0


def test_micro_batches_all_reduce_across_replicas_once_per_mini_batch(job):
    """2 micro-batches per rank per mini-batch: the replicas' all-reduce runs on the last one only
    (vlrl.workers.fsdp.set_replica_all_reduce), with the same gradients and training as flat."""
    for r in job:
        assert r["micro/micro_batches"] == [2, 2]
        assert r["micro/grad_norm"] > 0
        assert r["micro/grads_err"] < 1e-5
        for key in ("losses", "grad_norms"):
            flat, hybrid = r[f"micro/flat/{key}"], r[f"micro/hybrid/{key}"]
            assert hybrid == pytest.approx(flat, rel=REL, abs=1e-6), key
        assert r["micro/weights_err"] < 1e-5
        # one all-reduce per FSDP unit (each has trainable weights) per mini-batch
        assert r["micro/replica_all_reduces"] == r["micro/fsdp_units"] * r["micro/mini_batches"]
        assert r["micro/pending"] is False
