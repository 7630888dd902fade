"""Every `examples/*.yaml` runs as its header says, from a folder laid out like this repository:
its data made by the example's own prepare script (or, for the multi-image recipe, by
examples/data/make_multi_image.py), hub ids as local folders (`recipe_assets`), then the real CLI
for 2 steps with one validation and one checkpoint save, sizes shrunk for a 2-core CPU
(`recipe_runs.cpu_sizes`; the quickstart and the multi-turn demo are CPU-sized already and keep
their lengths and pixels).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from recipe_runs import REPO, cpu_sizes, given, run_command

from vlrl.config.loader import load_config

pytestmark = pytest.mark.slow

# example -> (commands that make its data, run from the folder; CPU-sized already)
EXAMPLES: dict[str, tuple[list[list[str]], bool]] = {
    "quickstart.yaml": ([["examples/prepare_quickstart.py"]], True),
    "multi_turn_demo.yaml": ([["examples/prepare_multi_turn_demo.py", "--warmup-steps", "10"]], True),
    "reasoning_quickstart.yaml": ([["examples/prepare_reasoning.py", "--warmup-steps", "10", "--colour-steps", "5"]], True),
    "qwen2_5_3b_gsm8k_calculator.yaml": ([["examples/prepare_gsm8k.py", "--synthetic", "16", "--out", "data/gsm8k"]], False),
    "qwen2_5_vl_3b_geo3k_grpo.yaml": ([], False),
    "qwen2_5_vl_3b_multi_image.yaml": ([["examples/data/make_multi_image.py", "data/multi_image", "--n-train", "8", "--n-val", "4"]], False),
    "qwen2_5_vl_7b_dapo.yaml": ([], False),
    "qwen2_5_vl_7b_geo3k_grpo.yaml": ([], False),
    "qwen3_5_27b_geo3k_grpo.yaml": ([], False),  # the Qwen3.5 family's row (padded, chunked prefill)
    "internvl3_8b_geo3k_grpo.yaml": ([], False),  # the InternVL family's row (processor expansion)
    "smolvlm2_2b_geo3k_grpo.yaml": ([], False),  # the SmolVLM family's row (tiles as [1, tiles, C, H, W])
    "glm4_1v_9b_geo3k_grpo.yaml": ([], False),  # the GLM-4.1V family's row (its own token names and bounds)
    "qwen2_5_vl_7b_geo3k_zoom.yaml": (
        [["examples/prepare_zoom_data.py", "--source", f"hiyouga/geometry3k@{split}", "--out", f"data/geo3k_zoom/{split}.jsonl"]
         for split in ("train", "test")],
        False,
    ),
}  # fmt: skip


# The model families' rows (docs/models.md): after the 2 steps, the run resumes for a third, and its
# checkpoint merges into a folder transformers loads (issue: every family trains, saves, resumes
# and exports through the CLI).
FAMILY_ROWS = {"qwen3_5_27b_geo3k_grpo.yaml", "internvl3_8b_geo3k_grpo.yaml", "smolvlm2_2b_geo3k_grpo.yaml",
               "glm4_1v_9b_geo3k_grpo.yaml"}  # fmt: skip

# the pass-rate sampler runs in these (rewards with an `accuracy` part; the DAPO recipe with online
# filtering), the default shuffle in the others: the matrix passes with it on and off
PASS_RATE_SAMPLER = {"reasoning_quickstart.yaml", "qwen2_5_vl_7b_dapo.yaml"}


def test_every_example_is_in_the_matrix() -> None:
    assert sorted(EXAMPLES) == sorted(p.name for p in (REPO / "examples").glob("*.yaml"))


@pytest.fixture
def repo_dir(easyr1_assets: Path, tmp_path: Path) -> Path:
    """A folder laid out like this repository (examples/, format_prompts/, reward_functions/), with
    the hub ids of the recipes as local folders."""
    for name in ("examples", "format_prompts", "reward_functions"):
        (tmp_path / name).symlink_to(REPO / name, target_is_directory=True)
    for owner in ("hiyouga", "Qwen", "OpenGVLab", "HuggingFaceTB", "zai-org"):
        (tmp_path / owner).symlink_to(easyr1_assets / owner, target_is_directory=True)
    return tmp_path


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_runs(example: str, repo_dir: Path, ray_address: str) -> None:
    prepare, cpu_sized = EXAMPLES[example]
    for command in prepare:
        done = subprocess.run([sys.executable, *command], cwd=repo_dir, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
    args = [f"config=examples/{example}"]
    defaults = load_config([f"config={REPO / 'examples' / example}"], finalize=False).to_dict()
    args += cpu_sizes(args, defaults, lengths=not cpu_sized)
    if example in PASS_RATE_SAMPLER:
        args.append("data.sampler=pass_rate")
    proc = run_command(repo_dir, args, ray_address)
    assert proc.returncode == 0, proc.stderr[-6000:]
    if example in PASS_RATE_SAMPLER:  # the start-up line says where the sampler's own choices start
        assert "data.sampler=pass_rate: until every prompt was drawn once (" in proc.stderr
    value: Any = lambda key: given(args, key, defaults)  # noqa: E731
    run = repo_dir / (
        value("trainer.save_checkpoint_path")
        or f"checkpoints/{value('trainer.project_name')}/{value('trainer.experiment_name')}"
    )
    assert (run / "global_step_2" / "actor").is_dir() and not list(run.glob("*.tmp"))
    if "file" in value("trainer.logger"):
        rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows if "reward/overall" in row] == [1, 2]
        assert sum("val/overall" in row for row in rows) == 1
        assert all(row["prompts/seen_share"] > 0 for row in rows if "reward/overall" in row)
    else:  # the console's step lines
        assert "[step 2] reward/overall=" in proc.stderr
        assert "val/overall=" in proc.stderr.split("[step 2] reward/overall=", 1)[1]
    if example in FAMILY_ROWS:
        _resume_and_merge(repo_dir, args, run, ray_address, repo_dir / value("worker.actor.model.model_path"))


def _resume_and_merge(repo_dir: Path, args: list[str], run: Path, ray_address: str, model_path: Path) -> None:
    """A third step from the step-2 checkpoint, then its checkpoint as a transformers folder with
    every weight of the model it trained."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from vlrl.tools.model_merger import merge

    proc = run_command(
        repo_dir, [*args, "trainer.max_steps=3", "trainer.find_last_checkpoint=true"], ray_address
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "resumed from" in proc.stdout + proc.stderr and "[step 3] reward/overall=" in proc.stderr
    assert (run / "global_step_3" / "actor").is_dir()
    merged = Path(merge(str(run / "global_step_3" / "actor")))
    model = AutoModelForImageTextToText.from_pretrained(merged)
    assert (
        model.config.model_type == AutoModelForImageTextToText.from_pretrained(model_path).config.model_type
    )
    names = [safe_open(str(folder / "model.safetensors"), "pt").keys() for folder in (merged, model_path)]
    assert sorted(names[0]) == sorted(names[1])
