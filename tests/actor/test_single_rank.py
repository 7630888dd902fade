"""The actor and reference on a 1-rank gloo group (one forked process; see actor_single_job.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from actor_helpers import launch

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def job(actor_model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import actor_single_job

    out = tmp_path_factory.mktemp("single_rank")
    models = {arch: actor_model(arch) for arch in ("qwen2_5_vl", "qwen2", "qwen3_vl")}
    launch(actor_single_job.run, 1, models, str(out))
    return torch.load(Path(out) / "results.pt", weights_only=False)


@pytest.mark.parametrize("variant", ["packed", "padded", "dynamic"])
def test_actor_log_probs_match_the_plain_model(job, variant):
    assert job[f"logp_err/{variant}"] < 1e-4


@pytest.mark.parametrize("setting", ["easyr1", "dual_only", "unweighted", "trl"])
def test_the_update_equals_a_bare_transformers_and_torch_loop(job, setting):
    """Two mini-batches, micro-batches of 3, grad-norm clipping, AdamW: the weights move as in
    tests/actor/bare_loop.py's loop (Adam turns float noise in a gradient near 0 into a step, so
    equal is a gap below 1e-3 of the update's size) with EasyR1's dual clip and k3 bound, the dual
    clip alone, neither, and neither with the KL weighted by the ratio (TRL 1.16's loss)."""
    assert job[f"bare/{setting}/gap"] < 1e-3


def test_the_dual_clip_the_k3_bound_and_the_kl_weight_bind_in_the_bare_loop_check(job):
    """Else the check above could not tell them apart: the bound clamps 9% of the tokens there,
    and the settings' updates part by more than a tenth of their size."""
    assert job["bare/easyr1/clamped"] > 0.02 and job["bare/trl/clamped"] == 0
    for name in ("easyr1", "dual_only", "unweighted"):
        assert job[f"bare/{name}/vs_trl"] > 0.1, name


def test_reference_log_probs_match(job):
    assert job["ref_err"] < 1e-4


def test_save_hf_reloads_with_transformers(job):
    assert job["moved"] > 1e-3  # the update changed the policy
    assert job["hf_err"] < 1e-4
    assert job["hf_processor"].startswith("Qwen2_5_VL")
    assert job["hf_attn"] != "vlrl_varlen"


def test_gradient_checkpointing_keeps_packed_attention(job):
    assert job["ckpting_layers/False"] == 0 and job["ckpting_layers/True"] > 0
    assert job["ckpting_grad_err"] < 1e-6


def test_warmup_cosine_schedule_with_bf16_adamw(job):
    assert job["lrs"] == pytest.approx(job["lrs_expected"], rel=1e-6)
    assert job["lrs"][0] < job["lrs"][1] > job["lrs"][-1]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_vl"])
def test_other_architectures(job, arch):
    assert job[f"{arch}/logp_err"] < 1e-4
    losses = job[f"{arch}/losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_text_model_export_has_its_tokenizer(job):
    assert job["text_tokenizer_vocab"] == job["text_vocab"]


def test_tied_embeddings_train_and_export(job):
    assert job["tied/in_actor"] and job["tied/reloaded"]
    assert job["tied/err"] < 1e-4


def test_on_policy_update_needs_no_old_log_probs(job):
    assert job["on_policy/config"]  # global_batch_size = rollout_batch_size, ppo_epochs 1, no KL
    assert job["on_policy/filled_err"] < 1e-5  # the update's own log-probs = the old pass's
    assert job["on_policy/moved"] > 1e-3  # the update changed the policy ...
    assert job["on_policy/after_err"] < 1e-5  # ... exactly as with the separate old pass
    assert "needs batch.old_log_probs" in job["on_policy/two_steps_error"]


def test_first_mini_batch_old_log_probs_from_the_update(job):
    """`old_log_probs=mixed`: the pass skips the first mini-batch; the update's weights equal those
    after a full old pass."""
    assert job["mixed/config"] == "mixed"  # 2 mini-batches, no KL in the reward, synchronous
    assert job["mixed/steps/True"] == job["mixed/steps/False"] == 2
    assert job["mixed/filled_err"] < 1e-5  # the update's own = the pass's
    assert job["mixed/moved"] > 1e-3 and job["mixed/after_err"] < 1e-5
    assert abs(job["mixed/ppo_kl"]) < 1.0  # the garbage rows (7.0) were never read as old log-probs


def test_no_advantage_guard_skips_only_steps_without_signal(job):
    assert job["guard/True/moved"] == 0 and job["guard/True/optimizer_state"] == 0
    assert job["guard/True/no_advantage_steps"] == 1 and job["guard/True/global_step"] == 1
    assert job["guard/True/signal_moved"] > 1e-4  # a mini-batch with signal still steps
    assert job["guard/False/moved"] > 1e-4 and job["guard/False/no_advantage_steps"] == 0


def test_nonfinite_weights_stop_the_run_before_a_checkpoint(job):
    assert job["nonfinite/update_error"].startswith("optimizer step 2 made the weights inf/nan")
    assert job["nonfinite/save_error"].startswith("the weights hold inf/nan: no checkpoint is written")
    assert not job["nonfinite/ckpt_written"]


def test_nonfinite_gradients_are_skipped_then_stop_the_run(job):
    assert job["nonfinite/skipped"] == [1.0]  # the first is skipped and counted
    assert job["nonfinite/skip_error"].startswith("2 optimizer steps in a row had a non-finite gradient norm")
