"""The end-of-run plot: a panel per logged metric of reward, accuracy, response length and entropy,
and the pass-rate histogram of the prompts seen over the steps."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from vlrl.data.prompt_stats import hist_key
from vlrl.trainer.summary import plot_history


def test_plot_has_a_panel_per_logged_metric(tmp_path: Path) -> None:
    full = [
        {"step": s, "reward/overall": 0.1 * s, "reward/accuracy": 0.05 * s, "response_length/mean": 30.0 - s,
         "actor/entropy": 0.2}
        for s in range(1, 6)
    ]  # fmt: skip
    full.append({"step": 5, "val/overall": 0.5})  # a validation-only row
    keys = plot_history(full, str(tmp_path / "a" / "full.png"))
    assert keys == ["reward/overall", "reward/accuracy", "response_length/mean", "actor/entropy"]
    no_parts = [{"step": s, "reward/overall": 0.5, "response_length/mean": 1.0} for s in range(1, 4)]
    assert plot_history(no_parts, str(tmp_path / "short.png")) == ["reward/overall", "response_length/mean"]
    tall, short = Image.open(tmp_path / "a" / "full.png"), Image.open(tmp_path / "short.png")
    assert tall.size[1] > short.size[1]  # taller with more panels
    hist = [{"step": s, **{hist_key(b): float(b == s) for b in range(10)}} for s in range(1, 6)]
    with_hist = [{**row, **h} for row, h in zip(full, hist)] + full[-1:]
    assert plot_history(with_hist, str(tmp_path / "hist.png"))[-1] == "prompts/pass_rate_hist"
    assert Image.open(tmp_path / "hist.png").size[1] > tall.size[1]
