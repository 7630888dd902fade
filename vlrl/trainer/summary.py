"""End-of-run summary: a few lines on the console and a PNG of reward and response length per step."""

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
    steps = [h["step"] for h in history]
    k = min(10, len(rewards))
    print(
        f"[vlrl] done: {len(history)} steps; reward/overall first {rewards[0]:.3f}, last {rewards[-1]:.3f}, "
        f"mean of first {k} {_window_mean(rewards[:k], k):.3f}, mean of last {k} {_window_mean(rewards, k):.3f}; "
        f"mean step time {sum(h.get('timing/step', 0.0) for h in history) / len(history):.2f} s",
        flush=True,
    )
    path = config.trainer.plot_path
    if path:
        plot_history(steps, rewards, [h.get("response_length/mean", float("nan")) for h in history], path)
        print(f"[vlrl] wrote {path}", flush=True)


def plot_history(steps: list[float], rewards: list[float], lengths: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, rewards, marker=".")
    top.set_ylabel("mean reward")
    top.grid(alpha=0.3)
    bottom.plot(steps, lengths, marker=".", color="tab:orange")
    bottom.set_ylabel("mean response length (tokens)")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
