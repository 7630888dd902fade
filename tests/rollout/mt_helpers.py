"""Multi-turn test helpers: a tiny model taught to call tools on cue, and engine configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image
from rollout_helpers import data_config, image, prompt_batch, rollout_config

from vlrl.config import MultiTurnConfig

TOOLS = str(Path(__file__).with_name("mt_tools.py"))

# The interaction's question, and the cue row (1 + 2) whose answer the model is taught to repeat after it.
FOLLOW_UP, FOLLOW_UP_ROW = "Are you sure?", 1

# prompt row -> (the call the model is taught to make, the tool's answer it sees, its final answer)
CUES = [
    ({"problem": "show", "answer": "red", "images": []},
     '{"name": "show", "arguments": {"colour": "red"}}', ("here is red", [Image.new("RGB", (56, 56), "red")]), "red"),
    ({"problem": "<image> 1 + 2 =", "answer": "3", "images": [image(0)]},
     '{"name": "add", "arguments": {"a": 1, "b": 2}}', ("3", []), "3"),
    ({"problem": "hang", "answer": "no", "images": []},
     '{"name": "hang", "arguments": {}}', ("error: hang timed out after 1s", []), "no"),
    ({"problem": "bad", "answer": "no", "images": []},
     '{name: show}', ("error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at char 1)", []), "no"),
]  # fmt: skip


def mt_config(**kwargs: Any) -> MultiTurnConfig:
    names = ["add", "show", "secret", "boom", "hang", "slow"]
    values = dict(enable=True, tools=[f"{TOOLS}:{n}" for n in names], tool_timeout=1.0, tool_workers=2,
                  interaction=f"{TOOLS}:follow_up")  # replies only to rows that ask (FOLLOW_UP)  # fmt: skip
    values.update(kwargs)
    return MultiTurnConfig(**values)


def mt_rollout_config(**kwargs: Any) -> Any:
    config = rollout_config(**kwargs)
    config.multi_turn = mt_config()
    return config


def taught_model(model_dir: str, steps: int = 150) -> dict[str, float]:
    """Fit the tiny model (with tool tokens) to answer every CUES prompt with its call, then its answer."""
    from vlrl.models.processor import load_processor
    from vlrl.rollout.multi_turn.rendering import TurnRenderer
    from vlrl.tools.turn_warmup import Segment, fit_segments

    tokenizer, processor = load_processor(model_dir)
    renderer = TurnRenderer(tokenizer, processor.chat_template, True, 256)
    prompts = prompt_batch(model_dir, [c[0] for c in CUES])
    examples = []
    for i, (_, call, (result, images), answer) in enumerate(CUES):
        examples.append([
            Segment(prompts.prompts[i], images=prompts.images[i]),
            Segment(f"<tool_call>{call}</tool_call>", trained=True),
            Segment(renderer.tool_turn(result, len(images)), images=images),
            Segment(f"{answer}<|im_end|>", trained=True),
        ])  # fmt: skip
        if i == FOLLOW_UP_ROW:  # after the interaction's question the model answers again, the same
            examples[-1] += [Segment(renderer.user_turn(FOLLOW_UP, "<|im_end|>")),
                             Segment(f"{answer}<|im_end|>", trained=True)]  # fmt: skip
    return fit_segments(model_dir, examples, steps=steps, batch_size=8, lr=2e-3)


__all__ = [
    "CUES",
    "FOLLOW_UP",
    "FOLLOW_UP_ROW",
    "TOOLS",
    "data_config",
    "mt_config",
    "mt_rollout_config",
    "prompt_batch",
    "taught_model",
]
