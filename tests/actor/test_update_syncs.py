"""At most a fixed number of host-device syncs per mini-batch in `Actor.update_policy`, whatever the
number of micro-batches (counted on CPU by tests/actor/sync_counter.py; see tests/actor/sync_job.py).

What is allowed, per mini-batch: the gradient norm read by `clip_and_step` (whether to skip a
non-finite step); on-policy, the mini-batch's computed log-probs copied to the host once. Per update:
the metric sums read once (`_UpdateStats.local_sums`) and `weights_finite`'s answer; with several
ranks (where `ShardedModel.all_reduce` reads its device tensor; on 1 rank it returns its host list)
also the all-reduces of the mini-batch count, of every mini-batch's token counts and advantage flags
(one for the whole update), of the token budget and micro-batch counts (`plan_mini_batches`), of
the media flags, the metrics and the throughput. Nothing per micro-batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from actor_helpers import launch

pytestmark = pytest.mark.timeout(900)

MINI_BATCHES = 2
PER_MINI_BATCH = 1  # the grad norm
PER_UPDATE = 2  # the metric sums + weights_finite
# 2 ranks: + the all-reduces of the mini-batch count, the per-mini-batch totals, the widest row (the
# default token budget), the micro-batch counts, the metric sums and the throughput (a text model:
# no media flags)
PER_UPDATE_TWO_RANKS = PER_UPDATE + 6


@pytest.fixture(scope="module")
def job(actor_model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import sync_job

    out = tmp_path_factory.mktemp("syncs")
    models = {arch: actor_model(arch) for arch in ("qwen2", "qwen2_5_vl")}
    launch(sync_job.run, 1, models, str(out))
    return torch.load(Path(out) / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def two_ranks(actor_model, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import sync_job

    out = tmp_path_factory.mktemp("syncs2")
    launch(sync_job.run_two_ranks, 2, actor_model("qwen2"), str(out))
    return [torch.load(Path(out) / f"two_ranks_{rank}.pt", weights_only=False) for rank in range(2)]


def _total(result: dict[str, Any]) -> int:
    """Syncs of vlrl's code (the Hugging Face model's own are counted apart, `model_*`)."""
    return sum(v for k, v in result["counts"].items() if not k.startswith("model_"))


def _ours(result: dict[str, Any]) -> dict[str, int]:
    return {k: v for k, v in result["counts"].items() if not k.startswith("model_")}


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_5_vl"])
@pytest.mark.parametrize("variant", ["packed", "padded", "on_policy"])
def test_syncs_do_not_grow_with_micro_batches(job, arch, variant):
    one, four = job[f"{arch}/{variant}/4"], job[f"{arch}/{variant}/1"]
    assert _ours(one) == _ours(four), (one["where"], four["where"])
    minis = 1 if variant == "on_policy" else MINI_BATCHES
    bound = minis * (PER_MINI_BATCH + (variant == "on_policy")) + PER_UPDATE
    assert _total(four) <= bound, four["where"]


@pytest.mark.parametrize("rank", [0, 1])
def test_two_ranks_one_sync_per_mini_batch(two_ranks, rank):
    """With real all-reduces: each extra mini-batch adds exactly one sync (its gradient norm), the
    micro-batch split adds none."""
    result = two_ranks[rank]
    for minis in (2, 4):
        one, four = result[f"{minis}/4"], result[f"{minis}/1"]
        assert _ours(one) == _ours(four), (one["where"], four["where"])
        assert _total(four) <= minis * PER_MINI_BATCH + PER_UPDATE_TWO_RANKS, four["where"]
    assert _total(result["4/1"]) - _total(result["2/1"]) == 2 * PER_MINI_BATCH, result["4/1"]["where"]


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_5_vl"])
def test_token_budget_micro_batches_add_no_syncs(job, arch):
    one, several = job[f"{arch}/dynamic/1000"], job[f"{arch}/dynamic/40"]
    assert _ours(one) == _ours(several), (one["where"], several["where"])
    assert _total(several) <= MINI_BATCHES * PER_MINI_BATCH + PER_UPDATE, several["where"]


def test_metrics_unchanged_by_the_split(job):
    one, four = job["qwen2/packed/4"]["metrics"], job["qwen2/packed/1"]["metrics"]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm"):
        assert four[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("mode", ["fixed", "budget"])
def test_log_prob_pass_reads_the_device_once(job, mode):
    """`compute_log_probs` (old log-probs, reference): one copy of the [N, R] result to the host,
    with 1 micro-batch or 8."""
    one, eight = job[f"log_probs/{mode}/8"], job[f"log_probs/{mode}/1"]
    assert _ours(one) == _ours(eight) == {"read": 1}, (one["where"], eight["where"])


@pytest.mark.parametrize("split", ["fixed/4", "budget/default", "budget/40"])
def test_token_budget_gradients_equal_fixed_micro_batches(job, split):
    """Same rows, same loss normalisation (per mini-batch): only the summation order differs."""
    ref, other = job["split/fixed/1"], job[f"split/{split}"]
    assert sum(other["micro_batches"]) == sum(ref["micro_batches"])
    if split == "budget/40":
        assert len(other["micro_batches"]) > 1  # the budget really splits the mini-batch
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(other["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    for key, value in ref["metrics"].items():
        if key.startswith("actor/") and key not in ("actor/lr", "actor/grad_norm"):
            assert other["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
