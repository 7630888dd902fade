"""`TrainingData`: rules that need the rows are checked when the data is set up, before Ray and the
ranks start (a long run must not die at its first generation or forward pass on them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlrl.config import ConfigError, PPOConfig
from vlrl.config.checks import check_data_media
from vlrl.config.loader import load_config
from vlrl.trainer.data_setup import TrainingData

MT_TOOLS = Path(__file__).resolve().parents[1] / "rollout" / "mt_tools.py"
SP = "worker.actor.ulysses_size=2"
MULTI_TURN = f"worker.rollout.multi_turn.interaction={MT_TOOLS}:follow_up"  # no tool pool to start
HF = "worker.rollout.name=hf"
# each feature's problem names the data's video column and the key that clashes with it
PROBLEMS = {
    SP: "but worker.actor.ulysses_size=2: sequence parallelism does not take videos yet; "
    "set worker.actor.ulysses_size=1",
    MULTI_TURN: "but worker.rollout.multi_turn.enable=true: multi-turn rollouts do not take videos yet",
    HF: "which only the vLLM engine takes: set worker.rollout.name=vllm (not 'hf')",
}
HAS = "the data has videos (up to 1 per prompt, column data.video_key='videos')"


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vlrl.data.synthetic import make_moving_square_dataset
    from vlrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("data_setup")
    model = build_tiny_model(root / "model", arch="qwen2_5_vl", min_pixels=3136, max_pixels=3136)
    train, val = make_moving_square_dataset(root / "data", n_train=4, n_val=1, frames=4)
    return {"model": model, "train": Path(train), "val": Path(val)}


def _config(base: list[str], assets: dict[str, Path], *overrides: str) -> PPOConfig:
    extra = ["worker.rollout.multi_turn.enable=true"] if MULTI_TURN in overrides else []
    return load_config([
        *base, f"worker.actor.model.model_path={assets['model']}",
        f"data.train_files={assets['train']}", f"data.val_files={assets['val']}",
        "data.prompt_key=problem", "data.rollout_batch_size=4", "data.min_pixels=3136", "data.max_pixels=3136", *extra, *overrides,
    ])  # fmt: skip


# (multi-turn with the HF engine is refused by the config alone: tests/rollout/test_mt_config.py)
@pytest.mark.parametrize(
    "features",
    [(SP,), (MULTI_TURN,), (HF,), (SP, MULTI_TURN), (SP, HF)],
    ids=["sp", "multi_turn", "hf", "sp+multi_turn", "sp+hf"],
)
def test_videos_with_features_that_do_not_take_them_fail_at_data_setup(base, assets, features):
    config = _config(base, assets, *features)  # each loads: the rule needs the data
    with pytest.raises(ConfigError) as info:
        TrainingData(config)
    lines = str(info.value).splitlines()
    assert lines[0] == "the data does not fit the config:"
    assert len(lines) == 1 + len(features)  # one problem per feature, all reported at once
    for line, feature in zip(lines[1:], features):
        assert line.startswith(f"  - {HAS}, {PROBLEMS[feature]}"), line


def test_videos_with_vllm_single_turn_and_no_sp_set_up(base, assets):
    data = TrainingData(_config(base, assets))
    assert data.max_videos_per_prompt == 1


def test_features_without_videos_are_not_refused():
    config = PPOConfig()
    config.worker.actor.ulysses_size, config.worker.rollout.name = 2, "hf"
    config.worker.rollout.multi_turn.enable = True
    assert check_data_media(config, 0) == []
    assert len(check_data_media(config, 1)) == 3
