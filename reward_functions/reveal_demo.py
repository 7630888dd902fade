"""Reward of the multi-turn demo (examples/multi_turn_demo.yaml): the colour answer, plus a small bonus
for a tool call that ran.

    accuracy  the final answer names the right colour (reward_functions/shapes.py's rule)
    called    1.0 when the trajectory made at least one tool call that returned without error
    overall   accuracy + call_bonus * called   (call_bonus: kwarg, default 0.1)

Why the bonus: until the model reads the tool's result, a call earns the same chance reward (0.25)
as answering at once, so GRPO's advantages give the call tokens nothing to hold on to (a group's
advantages sum to zero over its identical calls) and the call format drifts away under the answer's
updates before reading is learned. The bonus makes a call that works worth a little on its own; it
says nothing about which colour is right. Report `accuracy` (reward/accuracy) as the task score.
Kwargs: call_bonus. Needs multi-turn rollouts (the `trajectory` input).
"""

from __future__ import annotations

from typing import Any

from vlrl.data.synthetic import COLOURS

REWARD_TYPE = "sequential"
_COLOURS = frozenset(COLOURS)


def compute_score(reward_input: dict[str, Any], call_bonus: float = 0.1) -> dict[str, float]:
    """Score one trajectory."""
    truth = str(reward_input["ground_truth"]).strip().lower()
    if truth not in _COLOURS:
        raise ValueError(f"ground truth {truth!r} is not a colour of vlrl.data.synthetic.COLOURS")
    text = reward_input["response"].lower()
    named = {c for c in _COLOURS if c in text}  # substrings: the tiny tokenizer glues words
    accuracy = 1.0 if named == {truth} else 0.0
    trajectory = reward_input.get("trajectory")
    if trajectory is None:
        raise ValueError("reveal_demo needs multi-turn rollouts (worker.rollout.multi_turn.enable=true)")
    called = 1.0 if any(not c["error"] for c in trajectory["tool_calls"]) else 0.0
    return {"overall": accuracy + call_bonus * called, "accuracy": accuracy, "called": called}
