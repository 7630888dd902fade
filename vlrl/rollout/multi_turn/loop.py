"""The turn loops: every sample generates until the end of a tool call or EOS, calls run in the tool
pool, results are appended, finished samples leave; then one `RolloutBatch`.

Two drivers of the same per-sample logic (`_take_turn`, `_run_calls`, `_interact`):

- `run` (per turn, the reference): `generate_turn(requests, max_tokens, turn)` takes
  [(unexpanded context ids, images)] with each request's token budget and returns
  [(sampled ids, log-probs or None)]; every turn of the batch waits for its slowest sample.
- `run_continuous`: a `TurnEngine` takes turns one request each and, step by step, hands back the
  turns that ended; a sample's next turn is queued as soon as its tool answered, while the others
  keep decoding (with `overlap_tools`, also while its tool runs).

Both stop a turn at `stop_token_ids` (EOS + the end-of-call token).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from vlrl.batch.rows import PromptBatch, RolloutBatch
from vlrl.rollout.multi_turn.parsing import CALL_END, ToolCall, parse_tool_call
from vlrl.rollout.multi_turn.rendering import TurnEncoder, TurnRenderer
from vlrl.rollout.multi_turn.shared_tools import SharedTools, TPGroup
from vlrl.rollout.multi_turn.tool_config import tool_entries
from vlrl.rollout.multi_turn.tool_pool import ToolPool
from vlrl.rollout.multi_turn.tools import ToolOutput
from vlrl.rollout.multi_turn.trajectory import Trajectory, assemble_trajectories

logger = logging.getLogger(__name__)

Request = tuple[list[int], list[Any]]
GenerateTurn = Callable[[list[Request], list[int], int], list[tuple[list[int], Sequence[float] | None]]]
TurnRequest = tuple[int, list[int], list[Any], int, int]  # (sample key, context ids, images, budget, turn)
EndedTurn = tuple[int, list[int], Sequence[float] | None]  # (sample key, sampled ids, log-probs or None)


class TurnEngine(Protocol):
    """An engine driven request by request (`run_continuous`)."""

    def submit(self, turns: list[TurnRequest]) -> None:
        """Queue one assistant turn per entry (unexpanded context, images, token budget, turn index)."""

    def step(self) -> list[EndedTurn]:
        """Advance the engine one scheduler step; the turns that ended in it."""

    def busy(self) -> bool:
        """Whether any submitted turn has not ended yet."""


def call_end_token_id(tokenizer: Any) -> int:
    """The id of `</tool_call>`; generation stops on it, so it must be one token."""
    ids = tokenizer.encode(CALL_END, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"multi_turn.format=hermes needs {CALL_END} to be one token of the tokenizer, but it encodes to "
            f"{ids}; use a tokenizer that has it (Qwen2.5-VL, Qwen3-VL) or add it as a token"
        )
    return ids[0]


class MultiTurnRollout:
    """Tools, rendering and the turn loop for one rank's engine."""

    def __init__(
        self,
        mt_config: Any,
        data_config: Any,
        tokenizer: Any,
        processor: Any | None,
        hf_config: Any,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        max_model_len: int,
        tp_group: TPGroup | None = None,
    ) -> None:
        """`tp_group`: this rank's tensor-parallel group (`shared_tools.build_tp_group`) when the
        engine spans several ranks: its leader runs the tools and broadcasts their outputs."""
        self.config, self.tokenizer = mt_config, tokenizer
        self.max_response_length, self.max_model_len = data_config.max_response_length, max_model_len
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), pad_token_id
        self.call_end_id = call_end_token_id(tokenizer)
        self.encoder = TurnEncoder(data_config, tokenizer, processor, hf_config)
        self.renderer = TurnRenderer(
            tokenizer,
            self.encoder.preparer.chat.template,
            processor is not None,
            mt_config.max_tool_response_tokens,
        )

        def start_pool() -> ToolPool:  # on the TP leader only (or the one rank of a TP=1 engine)
            return ToolPool(tool_entries(mt_config), mt_config.interaction, mt_config.tool_workers,
                            mt_config.tool_timeout, mt_config.max_tool_images)  # fmt: skip

        self.tools = SharedTools(start_pool, tp_group)

    @property
    def pool(self) -> ToolPool | None:
        """The tool processes of this rank (None on a TP peer other than the leader)."""
        return self.tools.pool

    _limit: int = 0  # the current call's response budget

    @property
    def stop_token_ids(self) -> list[int]:
        return [*self.eos_token_ids, self.call_end_id]

    def close(self) -> None:
        self.tools.close()

    # ------------------------------------------------------------------ the loop
    def run(
        self, prompts: PromptBatch, n: int, generate_turn: GenerateTurn, max_tokens: int | None = None
    ) -> RolloutBatch:
        """n trajectories per prompt (a prompt's samples adjacent); `max_tokens` (default
        data.max_response_length) bounds each whole response, tool and user turns included."""
        trajectories = self._start(prompts, n, max_tokens)
        turn = 0
        while True:
            active = [t for t in trajectories if not t.done and self._fits(t)]
            if not active:
                break
            budgets = [t.budget(self._limit, self.max_model_len) for t in active]
            outputs = generate_turn([(t.context_ids, t.images) for t in active], budgets, turn)
            calls: list[tuple[Trajectory, ToolCall | Any]] = []
            finished: list[Trajectory] = []
            for t, (ids, log_probs) in zip(active, outputs):
                self._take_turn(t, list(ids), log_probs, calls, finished)
            self._run_calls(calls)
            self._interact(finished)
            turn += 1
        return assemble_trajectories(prompts, trajectories, self.pad_token_id, self.encoder.positions)

    def run_continuous(
        self, prompts: PromptBatch, n: int, engine: TurnEngine, max_tokens: int | None = None
    ) -> RolloutBatch:
        """As `run`, but no turn waits for the others: after each engine step the turns that ended
        there (in sample order) have their calls run, and their next turns are queued before the
        next step. Tools run between steps, so which requests share a step, hence the sampling,
        depends on the inputs and the tools' answers only, never on timing. With
        `overlap_tools`, calls run while the engine keeps stepping (`_overlap_calls`): faster with
        slow tools, but the schedule then depends on when each tool finished (under TP, on the
        leader: `self.tools` hands its peers the leader's answers and finished calls)."""
        trajectories = self._start(prompts, n, max_tokens)
        turns = [0] * len(trajectories)
        engine.submit(self._next_turns(trajectories, range(len(trajectories)), turns))
        in_tools: dict[int, tuple[int, ToolCall]] = {}  # overlap_tools: pool ticket -> (sample key, call)
        while engine.busy() or in_tools:
            ended = sorted(engine.step(), key=lambda e: e[0]) if engine.busy() else []
            calls: list[tuple[Trajectory, ToolCall | Any]] = []
            finished: list[Trajectory] = []
            for key, ids, log_probs in ended:
                self._take_turn(trajectories[key], list(ids), log_probs, calls, finished)
                turns[key] += 1
            ready = [key for key, _, _ in ended]
            if self.config.overlap_tools:
                ready = self._overlap_calls(trajectories, ready, calls, in_tools, engine.busy())
            else:
                self._run_calls(calls)
            self._interact(finished)
            engine.submit(self._next_turns(trajectories, ready, turns))
        return assemble_trajectories(prompts, trajectories, self.pad_token_id, self.encoder.positions)

    def _overlap_calls(
        self,
        trajectories: list[Trajectory],
        ended: list[int],
        calls: list[tuple[Trajectory, ToolCall | Any]],
        in_tools: dict[int, tuple[int, ToolCall]],
        engine_busy: bool,
    ) -> list[int]:
        """overlap_tools: send this step's calls to the pool without waiting (malformed ones are
        answered at once), append the results that have come back, and return the sample keys
        whose next turn can start now (sorted). Waits for a result only when nothing else can run."""
        key_of = {id(trajectories[k]): k for k in ended}
        parsed = [(key_of[id(t)], c) for t, c in calls if isinstance(c, ToolCall)]
        tickets = self.tools.submit_calls(
            [(c.name, c.arguments, self._context(trajectories[k], c.name)) for k, c in parsed]
        )
        in_tools.update(zip(tickets, parsed))
        self._run_calls([(t, c) for t, c in calls if not isinstance(c, ToolCall)])
        waiting = {k for k, _ in in_tools.values()}
        ready = [k for k in ended if k not in waiting]
        done = self.tools.poll(set(in_tools), block=not engine_busy and not ready)
        for ticket in sorted(done):
            key, call = in_tools.pop(ticket)
            self._add_result(trajectories[key], call, done[ticket])
            ready.append(key)
        return sorted(ready)

    def _start(self, prompts: PromptBatch, n: int, max_tokens: int | None) -> list[Trajectory]:
        self._limit = max_tokens or self.max_response_length
        self.encoder.new_call()
        return [
            Trajectory(
                prompt_row=i // n,
                context_ids=list(prompts.raw_prompt_ids[i // n]),
                images=list(prompts.images[i // n]),
                prompt_length=int(prompts.attention_mask[i // n].sum()),
                tool_context=self.row_context(prompts.extras[i // n], i // n),
                ground_truth=prompts.ground_truths[i // n],
            )
            for i in range(len(prompts) * n)
        ]

    def _fits(self, t: Trajectory) -> bool:
        """Whether another assistant turn has room for a token (else the trajectory ends: overflow)."""
        if t.budget(self._limit, self.max_model_len) < 1:
            t.stop_reason = "overflow"
        return not t.done

    def _next_turns(self, trajectories: list[Trajectory], keys: Any, turns: list[int]) -> list[TurnRequest]:
        return [
            (k, t.context_ids, t.images, t.budget(self._limit, self.max_model_len), turns[k])
            for k in keys
            if not (t := trajectories[k]).done and self._fits(t)
        ]

    def _take_turn(
        self,
        t: Trajectory,
        ids: list[int],
        log_probs: Sequence[float] | None,
        calls: list[tuple[Trajectory, ToolCall | Any]],
        finished: list[Trajectory],
    ) -> None:
        """Append a sampled turn; sort the trajectory into `calls` (ended at a call), `finished`
        (ended at EOS) or done (turn limit, length)."""
        t.add_generated(ids, log_probs, self.tokenizer.decode(ids, skip_special_tokens=True))
        last = ids[-1] if ids else None
        if last == self.call_end_id:
            if t.assistant_turns >= self.config.max_assistant_turns:
                t.stop_reason = "turn_limit"
            else:
                calls.append((t, parse_tool_call(self.tokenizer.decode(ids, skip_special_tokens=False))))
        elif last in self.eos_token_ids:
            finished.append(t)
        else:
            t.stop_reason = "length"

    def _run_calls(self, calls: list[tuple[Trajectory, Any]]) -> None:
        """Run the parsed calls in the pool (parse errors answer directly) and append the results."""
        parsed = [(t, c) for t, c in calls if isinstance(c, ToolCall)]
        outputs = self.tools.call([(c.name, c.arguments, self._context(t, c.name)) for t, c in parsed])
        results = dict(zip([id(t) for t, _ in parsed], outputs))
        for t, call in calls:
            self._add_result(t, call, results.get(id(t)) or ToolOutput(call.message, error=True))

    def _add_result(self, t: Trajectory, call: ToolCall | Any, out: ToolOutput) -> None:
        """Record a call's output (or a malformed call's message) and append its tool turn."""
        if out.images and self.encoder.spec is None:
            out = ToolOutput("error: the tool returned an image but this model reads text only", error=True)
        name = call.name if isinstance(call, ToolCall) else None
        args = call.arguments if isinstance(call, ToolCall) else None
        text, cut = self.renderer.truncate(out.text)
        t.tool_truncated += int(cut)
        t.tool_calls.append({"name": name, "arguments": args, "result": text, "images": len(out.images),
                             "error": out.error, "timed_out": out.timed_out})  # fmt: skip
        t.messages.append({"role": "tool", "name": name, "content": text, "images": len(out.images)})
        self._append(t, self.renderer.tool_turn(text, len(out.images)), out.images)

    def _interact(self, finished: list[Trajectory]) -> None:
        """Ask the interaction (if any) to reply to trajectories that ended a turn with EOS."""
        asking = [
            t for t in finished if self.config.interaction and t.user_turns < self.config.max_user_turns
        ]
        for t in finished:
            if t not in asking:
                t.stop_reason = "eos"
        if not asking:
            return
        contexts = [{"ground_truth": t.ground_truth, **self._context(t, "interaction")} for t in asking]
        replies = self.tools.interact([(t.messages, c) for t, c in zip(asking, contexts)])
        for t, reply in zip(asking, replies):
            if reply is None:
                t.stop_reason = "eos"
                continue
            t.user_turns += 1
            t.messages.append({"role": "user", "content": reply})
            eos_text = self.tokenizer.decode(t.response[-1:], skip_special_tokens=False)  # closes the turn
            self._append(t, self.renderer.user_turn(reply, eos_text), [])

    def _append(self, t: Trajectory, text: str, images: list[Any]) -> None:
        """Append a rendered turn, or end the trajectory (overflow) when it and one more token do not fit."""
        raw, expanded, images = self.encoder.encode(text, images)
        if t.budget(self._limit, self.max_model_len) < len(expanded) + 1:
            t.stop_reason = "overflow"
            return
        t.add_context(raw, expanded, images)

    def _context(self, t: Trajectory, name: str) -> dict[str, Any]:
        """The row's tool context for tool `name` (or "interaction")."""
        return dict(t.tool_context.get(name) or {})

    def row_context(self, extras: dict[str, Any], row: int) -> dict[str, Any]:
        """The row's `tools_kwargs_key` column as {tool name: {keyword: value}} ({} when absent)."""
        key = self.config.tools_kwargs_key
        value = extras.get(key)
        if isinstance(value, str):  # CSV stores it as JSON text
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as err:
                raise ValueError(f"prompt row {row}: column {key!r} is not valid JSON ({err})") from err
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(v, dict) or v is None for v in value.values()):
            raise ValueError(
                f"prompt row {row}: column {key!r} must map tool names to keyword dicts, got {str(value)[:100]}"
            )
        return value
