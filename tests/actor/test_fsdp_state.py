"""FSDP2 state on a 1-rank gloo group (see fsdp_job.py): resume keeps the optimizer's dtypes,
devices and values and continues exactly; which units are gathered after forward/backward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from actor_helpers import launch

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def job(actor_model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import fsdp_job

    out = tmp_path_factory.mktemp("fsdp_state")
    launch(fsdp_job.run, 1, {"qwen2": actor_model("qwen2")}, str(out))
    return torch.load(Path(out) / "results.pt", weights_only=False)


def test_resume_keeps_bf16_moments_and_devices(job):
    assert job["resume/keys_equal"]
    moments = {k: v for k, v in job["resume/dtypes"].items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert moments and all(saved == loaded == "torch.bfloat16" for saved, loaded in moments.values())
    assert all(saved == loaded for saved, loaded in job["resume/dtypes"].values())
    assert all(saved == loaded for saved, loaded in job["resume/devices"].values())
    assert job["resume/value_err"] == 0.0


def test_resume_continues_exactly(job):
    assert job["resume/continue_err"] == 0.0
    assert job["resume/lr"][0] == job["resume/lr"][1]


def test_extra_state_loads_without_pickled_objects(job):
    extra = torch.load(job["resume/extra_file"], weights_only=True)
    assert set(extra) == {"scheduler", "global_step", "skipped_steps", "rng"}


def test_reference_reshards_after_its_forward_without_full_shard(job):
    assert job["ref/before"] and job["ref/log_probs_finite"]
    gathered = [name for name, is_shard in job["ref/after"].items() if not is_shard]
    assert not gathered, f"still gathered after the reference forward: {gathered[:5]}"


@pytest.mark.parametrize("full_shard", [True, False])
def test_actor_log_prob_pass_leaves_only_shards(job, full_shard):
    gathered = [name for name, is_shard in job[f"actor_lp/after/{full_shard}"].items() if not is_shard]
    assert not gathered, f"still gathered after the old log-prob pass: {gathered[:5]}"


def test_root_unit_is_not_regathered_for_backward(job):
    assert job["root/layers_after_forward"] and all(job["root/layers_after_forward"].values())
    root = job["root/after_forward"]
    assert root and not any(root.values()), f"root unit freed after forward: {root}"
    assert job["root/after_backward"]
