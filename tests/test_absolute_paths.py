"""Relative local paths are made absolute at config load, against the launch folder (issue 31,
finding 4): a Ray rank worker runs in its raylet's folder, where a relative path names nothing."""

import logging
import os
from pathlib import Path

import pytest

from vlrl.config.loader import load_config
from vlrl.config.paths import PATH_KEYS, absolute_data, absolute_spec, make_paths_absolute


@pytest.fixture
def launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A launch folder holding a model, data, reward/tool/interaction files and templates; the
    run starts there, its YAML lies in another folder."""
    run = tmp_path / "run"
    for folder in ("models/tiny", "data/splits", "rewards", "tools", "images", "ckpt/global_step_2"):
        (run / folder).mkdir(parents=True)
    for name in ("data/train.jsonl", "data/splits/test.jsonl", "data/splits/train.jsonl"):
        (run / name).write_text("")
    for name in ("rewards/r.py", "tools/zoom.py", "tools/talk.py"):
        (run / name).write_text("def main(inputs):\n    return []\n")
    (run / "fmt.jinja").write_text("{{ content }}")
    (run / "chat.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (run / "tools.yaml").write_text("tools: []\n")
    monkeypatch.chdir(run)
    return run


def _relative_config(tmp_path: Path) -> list[str]:
    yaml_file = tmp_path / "elsewhere" / "c.yaml"
    yaml_file.parent.mkdir()
    yaml_file.write_text(
        "data:\n  train_files: data/train.jsonl\n  val_files: data/splits@test\n  format_prompt: fmt.jinja\n"
        "  override_chat_template: chat.jinja\n  image_dir: images\n"
        "worker:\n  actor:\n    model:\n      model_path: models/tiny\n"
        "  reward:\n    reward_function: rewards/r.py:main\n"
        "  rollout:\n    multi_turn:\n      tools: [tools/zoom.py:main]\n      tool_config_path: tools.yaml\n"
        "      interaction: ./tools/talk.py:main\n"
        "trainer:\n  save_checkpoint_path: runs/a\n  load_checkpoint_path: ckpt/global_step_2\n"
        "  plot_path: plots/p.png\n  ray_timeline: trace.json\n"
    )
    return [f"config={yaml_file}", "data.rollout_batch_size=8", "worker.actor.global_batch_size=4",
            "worker.actor.micro_batch_size_per_device_for_update=2", "worker.rollout.n=4",
            "trainer.n_gpus_per_node=2", "trainer.device=cpu"]  # fmt: skip


def test_relative_paths_resolve_against_the_launch_folder(launch: Path, tmp_path: Path) -> None:
    config = load_config(_relative_config(tmp_path))
    data, model, mt, trainer = (
        config.data,
        config.worker.actor.model,
        config.worker.rollout.multi_turn,
        config.trainer,
    )
    assert data.train_files == str(launch / "data/train.jsonl")
    assert data.val_files == f"{launch / 'data/splits'}@test"
    assert data.format_prompt == str(launch / "fmt.jinja")
    assert data.override_chat_template == str(launch / "chat.jinja")
    assert data.image_dir == str(launch / "images")
    assert model.model_path == model.tokenizer_path == str(launch / "models/tiny")
    assert config.worker.reward.reward_function == f"{launch / 'rewards/r.py'}:main"
    assert mt.tools == [f"{launch / 'tools/zoom.py'}:main"]
    assert mt.tool_config_path == str(launch / "tools.yaml")
    assert mt.interaction == f"{launch / 'tools/talk.py'}:main"
    assert trainer.save_checkpoint_path == str(launch / "runs/a")
    assert trainer.load_checkpoint_path == str(launch / "ckpt/global_step_2")
    assert trainer.plot_path == str(launch / "plots/p.png")
    assert trainer.ray_timeline == str(launch / "trace.json")
    # a rank worker in another folder (its raylet's) still finds every file
    os.chdir(tmp_path / "elsewhere")
    assert os.path.isdir(model.model_path) and os.path.isfile(data.train_files)
    assert os.path.isfile(config.worker.reward.reward_function.rsplit(":", 1)[0])


def test_hub_ids_templates_and_missing_paths_stay_as_written(launch: Path, tmp_path: Path) -> None:
    argv = [*_relative_config(tmp_path), "worker.actor.model.model_path=Qwen/Qwen2.5-VL-7B-Instruct",
            "data.val_files=data/train.jsonl, org/shapes@test", "data.format_prompt=missing.jinja",
            "data.override_chat_template={{ messages }}", "trainer.save_checkpoint_path=~/ckpt",
            "worker.rollout.multi_turn.tools=[tools/nope.py:main]"]  # fmt: skip
    config = load_config(argv, finalize=False)  # finalize would ask the hub about the model id
    config.derive()
    assert config.worker.actor.model.model_path == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert config.worker.actor.model.tokenizer_path == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert config.data.val_files == f"{launch / 'data/train.jsonl'},org/shapes@test"
    assert config.data.format_prompt == "missing.jinja"  # the start-up check names it as written
    assert config.data.override_chat_template == "{{ messages }}"
    assert config.worker.rollout.multi_turn.tools == ["tools/nope.py:main"]
    assert config.trainer.save_checkpoint_path == os.path.expanduser("~/ckpt")  # outputs: always local


def test_each_change_is_logged_once(launch: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(_relative_config(tmp_path), finalize=False)
    with caplog.at_level(logging.INFO, logger="vlrl.config"):
        config.derive()
    (record,) = [r for r in caplog.records if "made absolute" in r.getMessage()]
    assert f"against the launch folder {launch}" in record.getMessage()
    assert f"worker.actor.model.model_path: models/tiny -> {launch / 'models/tiny'}" in record.getMessage()
    assert make_paths_absolute(config) == []  # idempotent: a restart's reload changes nothing


def test_path_keys_name_config_fields() -> None:
    from vlrl.config import PPOConfig

    config = PPOConfig()
    for key in PATH_KEYS:
        section = config
        for part in key.split("."):
            section = getattr(section, part)  # raises on a renamed key


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("data", "{run}/data"),
        ("data@test", "{run}/data@test"),
        ("data/train.jsonl,org/name@train", "{run}/data/train.jsonl,org/name@train"),
        ("org/name@train", "org/name@train"),
        ("missing.jsonl", "missing.jsonl"),
    ],
)
def test_data_entries(launch: Path, spec: str, expected: str) -> None:
    assert absolute_data(spec) == expected.format(run=launch)


def test_specs_without_a_function(launch: Path) -> None:
    assert absolute_spec("rewards/r.py") == str(launch / "rewards/r.py")
    assert absolute_spec("rewards/r.py:not an identifier") == "rewards/r.py:not an identifier"
