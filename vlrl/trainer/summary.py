"""End-of-run summary: a few lines on the console and a PNG of reward, accuracy, response length and
entropy per step."""

from __future__ import annotations

import os

from vlrl.config import PPOConfig


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
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels) + 0.6), sharex=True, squeeze=False)
    steps = [h["step"] for h in history]
    for ax, (key, label), colour in zip(
        axes[:, 0], panels, ("tab:blue", "tab:green", "tab:orange", "tab:purple")
    ):
        ax.plot(steps, [h.get(key, float("nan")) for h in history], marker=".", color=colour)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [key for key, _ in panels]
