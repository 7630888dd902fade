"""`VLLMTurns`: a `vllm.LLM` driven request by request for `MultiTurnRollout.run_continuous`.

Each assistant turn is one request queued with `LLM.enqueue` (vLLM 0.32: renders the input and adds
it to the engine, no stepping); `step` runs one `LLMEngine.step` (one scheduler step of every
running request) and returns the turns that finished in it. Requests are FINAL_ONLY (set by
`enqueue`), so a step reports only finished turns. A turn's context is the trajectory so far, so
with prefix caching on its earlier tokens' KV blocks are reused, not recomputed.

Seeds: on the V2 runner (CUDA) each request carries its own seed, a function of (call seed, turn,
sample) only: sample k's turn t draws from `request_seeds(call seed + 7919 t)` base + k. On the V1
runner (CPU) sampling draws from torch's default generator, which the caller seeds once for the
whole call; the draws then depend on which requests share each step, and that is fixed by the
inputs and the tools' answers because the loop adds requests only between steps. TP peers make the
same decisions from the same outputs and the same tool answers (the TP leader's, `shared_tools`), so
they add the same requests in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vlrl.rollout import vllm_hooks
from vlrl.rollout.multi_turn.loop import EndedTurn, TurnRequest
from vlrl.rollout.vllm_inputs import ImageIds, vllm_request

TURN_SEED_STRIDE = 7919  # a turn's seed: call seed + stride x turn (as the per-turn loop)


class VLLMTurns:
    """The `TurnEngine` of one rank's `vllm.LLM`."""

    def __init__(
        self,
        llm: Any,
        params_for: Callable[[int, int | None], Any],
        call_seed: int | None,
        logprobs: bool,
        image_ids: ImageIds | None = None,
    ) -> None:
        """`params_for(budget, seed)`: `SamplingParams` of one turn (n=1, max_tokens=budget, the
        end-of-call stop token); `call_seed`: per-request seeds from it, or None (V1: torch RNG);
        `image_ids`: content ids sent with the images (vLLM then does not hash their pixels)."""
        self.llm, self.params_for, self.image_ids = llm, params_for, image_ids
        self.call_seed, self.logprobs = call_seed, logprobs
        self._keys: dict[str, int] = {}  # vLLM request id -> sample key

    def _seed(self, key: int, turn: int) -> int | None:
        if self.call_seed is None:
            return None
        return vllm_hooks.request_seeds(self.call_seed + TURN_SEED_STRIDE * turn, 1, 1)[0] + key

    def submit(self, turns: list[TurnRequest]) -> None:
        if not turns:
            return
        inputs, params = [], []
        for key, ids, images, budget, turn in turns:
            inputs.append(vllm_request(ids, images, image_ids=self.image_ids))
            params.append(self.params_for(budget, self._seed(key, turn)))
        # `enqueue` returns the engine's internal ids ("<id>-<8 random chars>", vLLM's
        # `InputProcessor.assign_request_id`); outputs carry the id before the suffix.
        request_ids = [rid.rsplit("-", 1)[0] for rid in self.llm.enqueue(inputs, params, use_tqdm=False)]
        self._keys.update(zip(request_ids, (key for key, *_ in turns)))

    def step(self) -> list[EndedTurn]:
        ended: list[EndedTurn] = []
        for output in self.llm.llm_engine.step():
            if not output.finished:
                continue
            sample = output.outputs[0]
            log_probs: Sequence[float] | None = None
            if self.logprobs and sample.logprobs is not None:
                log_probs = list(sample.logprobs.logprobs)
            ended.append((self._keys.pop(output.request_id), list(sample.token_ids), log_probs))
        return ended

    def busy(self) -> bool:
        if self._keys and not self.llm.llm_engine.has_unfinished_requests():
            raise RuntimeError(
                f"vLLM finished {len(self._keys)} multi-turn request(s) without reporting them"
            )
        return bool(self._keys)
