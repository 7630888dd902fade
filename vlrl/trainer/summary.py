"""End-of-run summary: a few lines on the console and a PNG of reward, accuracy, response length and
entropy per step, and of the training prompts' pass rates (`vlrl.data.prompt_stats`) over the steps."""

from __future__ import annotations

import os
from typing import Any

from vlrl.config import PPOConfig
from vlrl.data.prompt_stats import HIST_BINS, hist_key


def _window_mean(values: list[float], k: int) -> float:
    tail = values[-k:]
    return sum(tail) / max(len(tail), 1)


def write_summary(history: list[dict[str, float]], config: PPOConfig) -> None:
    if not history:
        return
    rewards = [h.get("reward/overall", float("nan")) for h in history]
    k = min(10, len(rewards))
    print(
        f"[vlrl] done: {len(history)} steps; reward/overall first {rewards[0]:.3f}, last {rewards[-1]:.3f}, "
        f"mean of first {k} {_window_mean(rewards[:k], k):.3f}, mean of last {k} {_window_mean(rewards, k):.3f}; "
        f"mean step time {sum(h.get('timing/step', 0.0) for h in history) / len(history):.2f} s",
        flush=True,
    )
    path = config.trainer.plot_path
    if path:
        plot_history(history, path)
        print(f"[vlrl] wrote {path}", flush=True)


# (metric, y label) per panel, top to bottom; a panel is drawn when some step logged its metric
PANELS = (
    ("reward/overall", "mean reward"),
    ("reward/accuracy", "mean accuracy"),
    ("response_length/mean", "mean response length (tokens)"),
    ("actor/entropy", "entropy (nats per token)"),
)


def plot_history(history: list[dict[str, float]], path: str) -> list[str]:
    """One panel per metric of `PANELS` that the run logged, against the step; returns their keys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(key, label) for key, label in PANELS if any(key in h for h in history)]
    with_hist = any(hist_key(0) in h for h in history)
    rows = len(panels) + with_hist
    fig, axes = plt.subplots(rows, 1, figsize=(7, 2.4 * rows + 0.6), sharex=True, squeeze=False)
    steps = [h["step"] for h in history]
    for ax, (key, label), colour in zip(
        axes[:, 0], panels, ("tab:blue", "tab:green", "tab:orange", "tab:purple")
    ):
        ax.plot(steps, [h.get(key, float("nan")) for h in history], marker=".", color=colour)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if with_hist:
        _pass_rate_panel(axes[-1, 0], [h for h in history if hist_key(0) in h])
        panels.append((hist_key(0).rsplit("/", 1)[0], ""))
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [key for key, _ in panels]


def _pass_rate_panel(ax: Any, rows: list[dict[str, float]]) -> None:
    """The pass-rate histogram of the prompts seen so far, one column per step of `rows` (colour:
    share of those prompts in the bin): a column moving up is the policy solving its prompts."""
    steps = [r["step"] for r in rows]
    shares = [[r[hist_key(b)] for r in rows] for b in range(HIST_BINS)]  # [bins, steps]
    image = ax.imshow(
        shares, aspect="auto", origin="lower", cmap="viridis", vmin=0.0,
        extent=(steps[0] - 0.5, steps[-1] + 0.5, 0.0, 1.0), interpolation="nearest",
    )  # fmt: skip
    ax.set_ylabel("pass rate of the\nprompts seen")
    ax.figure.colorbar(image, ax=ax, label="share of prompts", pad=0.01)
