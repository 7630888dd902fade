"""One multi-turn trajectory while it is rolled out, and the `RolloutBatch` built from all of them.

Layout of a trajectory's response (R_i tokens, image placeholders expanded):

    [assistant turn 1][tool turn 1][assistant turn 2][user turn] ... [final assistant turn]
     mask 1            mask 0       mask 1            mask 0          mask 1

Assistant turns are what the model sampled (with the engine's log-probs); tool and user turns are
context the chat template wrapped around tool results and interaction replies (mask 0, log-prob 0).
The engine is fed the *unexpanded* context (one `<|image_pad|>` per image, vLLM expands them), the
actor the expanded one; both hold the same images in token order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlrl.batch.rows import PromptBatch, RolloutBatch
from vlrl.rollout.output import pad_log_probs, pad_responses

STOP_REASONS = ("eos", "length", "overflow", "turn_limit")


@dataclass
class Trajectory:
    prompt_row: int  # row of the PromptBatch this sample answers
    context_ids: list[int]  # unexpanded ids for the engine: the prompt's raw ids + every turn so far
    images: list[Any]  # the prompt's images, then tool images, in token order
    prompt_length: int  # expanded prompt length (what counts against max_model_len)
    tool_context: dict[str, Any] = field(default_factory=dict)  # the row's {tool name: {keyword: value}}
    ground_truth: Any = None  # passed to the interaction
    response: list[int] = field(default_factory=list)  # expanded response ids
    mask: list[int] = field(default_factory=list)  # 1 on sampled tokens, 0 on tool/user turns
    log_probs: list[float] = field(default_factory=list)  # engine log-probs (0 on context tokens)
    messages: list[dict[str, Any]] = field(default_factory=list)  # assistant/tool/user turns as text
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    stop_reason: str | None = None  # set when the trajectory is finished (one of STOP_REASONS)
    tool_truncated: int = 0  # tool responses cut to max_tool_response_tokens

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def budget(self, max_response_length: int, max_model_len: int) -> int:
        """Tokens the next assistant turn may generate."""
        used = len(self.response)
        return min(max_response_length - used, max_model_len - self.prompt_length - used)

    def add_generated(self, ids: Sequence[int], log_probs: Sequence[float] | None, text: str) -> None:
        self.context_ids += ids
        self.response += ids
        self.mask += [1] * len(ids)
        self.log_probs += list(log_probs) if log_probs else [0.0] * len(ids)
        self.assistant_turns += 1
        self.messages.append({"role": "assistant", "content": text})

    def add_context(self, raw_ids: list[int], expanded_ids: list[int], images: list[Any]) -> None:
        """Append a tool or user turn (not trained on)."""
        self.context_ids += raw_ids
        self.response += expanded_ids
        self.mask += [0] * len(expanded_ids)
        self.log_probs += [0.0] * len(expanded_ids)
        self.images += images

    def info(self) -> dict[str, Any]:
        """What rewards and metrics see (plain values, no images)."""
        finals = [m["content"] for m in self.messages if m["role"] == "assistant"]
        return {
            "messages": self.messages,
            "tool_calls": self.tool_calls,
            "num_turns": self.assistant_turns,
            "num_user_turns": self.user_turns,
            "num_tool_calls": len(self.tool_calls),
            "tool_errors": sum(c["error"] for c in self.tool_calls),
            "tool_timeouts": sum(c["timed_out"] for c in self.tool_calls),
            "tool_truncated": self.tool_truncated,
            "stop_reason": self.stop_reason,
            "final_response": finals[-1] if finals else "",
        }


def assemble_trajectories(
    prompts: PromptBatch,
    trajectories: Sequence[Trajectory],
    pad_token_id: int,
    positions: Callable[[torch.Tensor, list[Any]], torch.Tensor],
) -> RolloutBatch:
    """The `RolloutBatch` of finished trajectories (N = len(trajectories), a prompt's samples adjacent).

    `positions(ids [L], images)` gives the position ids of one whole expanded sequence ([L] or
    [3, L]); the response part of each is taken from there, so images inside the response shift
    the positions after them exactly as in a single forward over the trajectory.
    """
    rows = [t.prompt_row for t in trajectories]
    expanded = prompts.select(rows)
    responses, _ = pad_responses([t.response for t in trajectories], pad_token_id)  # [N, R]
    width = responses.shape[1]
    real = torch.zeros_like(responses)  # [N, R] 1 on every trajectory token (sampled or context)
    mask = torch.zeros_like(responses)  # [N, R] 1 on sampled tokens only
    prompt_pos = expanded.position_ids  # [N, P] or [N, 3, P]
    response_pos = torch.zeros((*prompt_pos.shape[:-1], width), dtype=torch.long)
    for i, t in enumerate(trajectories):
        n = len(t.response)
        real[i, :n] = 1
        mask[i, :n] = torch.tensor(t.mask, dtype=torch.long)
        prompt_ids = expanded.input_ids[i][expanded.attention_mask[i].bool()]
        full = torch.cat([prompt_ids, torch.tensor(t.response, dtype=torch.long)])
        response_pos[i, ..., :n] = positions(full, t.images)[..., len(prompt_ids) :]
    return RolloutBatch(
        input_ids=torch.cat([expanded.input_ids, responses], dim=-1),
        attention_mask=torch.cat([expanded.attention_mask, real], dim=-1),
        position_ids=torch.cat([prompt_pos, response_pos], dim=-1),
        responses=responses,
        response_mask=mask,
        group_ids=torch.as_tensor(list(expanded.uids), dtype=torch.long),
        prompt_length=int(prompts.input_ids.shape[1]),
        images=[list(t.images) for t in trajectories],
        prompts=expanded.prompts,
        ground_truths=expanded.ground_truths,
        extras=expanded.extras,
        rollout_log_probs=pad_log_probs([t.log_probs for t in trajectories], width),
        trajectories=[t.info() for t in trajectories],
    )
