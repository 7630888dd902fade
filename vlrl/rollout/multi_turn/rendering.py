"""Text appended to a trajectory after an assistant turn: tool results and user replies, rendered by
the model's chat template.

The template renders whole conversations, so the appended text is a difference of two renderings:
a probe conversation ending with an assistant message `A`, and the same plus the new message with
a generation prompt. What follows `A` in the first is the assistant turn's closing (`<|im_end|>\\n`
for Qwen); the extra text in the second is the new turn and the next assistant header. Templates
that render tool messages as user turns with `<tool_response>` (Qwen3) work the same way.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from vlrl.data.images import resize_image
from vlrl.data.prepare import RowPreparer
from vlrl.data.prompts import expand_image_tokens
from vlrl.models.rope import mrope_position_ids, text_position_ids

_PROBE_USER = "vlrl-probe-question"
_PROBE_ANSWER = "vlrl-probe-answer"


class TurnRenderer:
    """Renders tool results and user replies as the text that follows an assistant turn."""

    def __init__(self, tokenizer: Any, chat_template: str, multimodal: bool, max_tool_tokens: int) -> None:
        self.tokenizer, self.template, self.multimodal = tokenizer, chat_template, multimodal
        self.max_tool_tokens = max_tool_tokens
        probe = self._after_assistant({"role": "tool", "content": "vlrl-probe-result"})
        if "vlrl-probe-result" not in probe:
            raise ValueError(
                "the chat template does not render tool messages; set data.override_chat_template to one that does"
            )

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, add_generation_prompt=generation_prompt, tokenize=False
        )

    def _after_assistant(self, message: dict[str, Any]) -> str:
        """Closing of an assistant turn + `message`'s turn + the next assistant header."""
        base = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ANSWER}]
        before = self._render(base, False)
        after = self._render([*base, message], True)
        if not after.startswith(before) or _PROBE_ANSWER not in before:
            raise ValueError("the chat template renders a conversation differently when a message is added")
        return before[before.rindex(_PROBE_ANSWER) + len(_PROBE_ANSWER) :] + after[len(before) :]

    def truncate(self, text: str) -> tuple[str, bool]:
        """`text` cut to `max_tool_tokens` tokens, and whether it was cut."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= self.max_tool_tokens:
            return text, False
        return self.tokenizer.decode(ids[: self.max_tool_tokens]) + " ...(truncated)", True

    def tool_turn(self, text: str, n_images: int) -> str:
        """The tool message with `n_images` images (placeholders, in front of the text)."""
        if self.multimodal:
            content: Any = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
        else:
            content = text
        return self._after_assistant({"role": "tool", "content": content})

    def user_turn(self, text: str, sampled_end: str = "") -> str:
        """A user reply (from the interaction). `sampled_end`: the text of the token that ended the
        assistant turn (its EOS, e.g. `<|im_end|>`): the model already wrote that part of the
        turn's closing, so it is not appended a second time."""
        content: Any = [{"type": "text", "text": text}] if self.multimodal else text
        rendered = self._after_assistant({"role": "user", "content": content})
        if sampled_end and rendered.startswith(sampled_end):
            return rendered[len(sampled_end) :]
        return rendered


class TurnEncoder:
    """Rendered turns to token ids, and positions of whole sequences, with the data pipeline's rules
    (pixel bounds, image token counts, mrope), so tool images are treated like prompt images.

    Tool images with the same pixels within one call (`new_call` to the next) come back as one
    object: a tool answering a GRPO group's n samples alike (the demo's `reveal`) then gives them
    shared images, as their prompt images are, and the actor's vision cache (keyed by image object)
    processes and encodes each once per pass instead of n times."""

    def __init__(self, data_config: Any, tokenizer: Any, processor: Any | None, hf_config: Any) -> None:
        self.tokenizer = tokenizer
        self.preparer = RowPreparer(data_config, tokenizer, processor, hf_config)
        self.spec = self.preparer.spec
        self._images: dict[tuple[str, tuple[int, int], bytes], Any] = {}  # pixels -> this call's image

    def new_call(self) -> None:
        """Forget the images of the last call (they are shared within a call only)."""
        self._images.clear()

    def _shared(self, image: Any) -> Any:
        """The image of this call with the same mode, size and pixels as `image` (first seen wins)."""
        key = (image.mode, image.size, hashlib.blake2b(image.tobytes(), digest_size=16).digest())
        return self._images.setdefault(key, image)

    def encode(self, text: str, images: list[Any]) -> tuple[list[int], list[int], list[Any]]:
        """(unexpanded ids for the engine, expanded ids for training, resized images) of one turn."""
        raw = self.tokenizer.encode(text, add_special_tokens=False)
        if not images:
            return raw, raw, []
        if self.spec is None:
            raise ValueError("a tool returned an image but the model is text-only")
        resized = [
            self._shared(resize_image(img, *self.preparer.target_size(img.height, img.width)))
            for img in images
        ]
        counts = self.preparer.tokens_per_image([(img.height, img.width) for img in resized])
        return raw, expand_image_tokens(raw, self.spec.image_token_id, counts), resized

    def positions(self, ids: torch.Tensor, images: list[Any]) -> torch.Tensor:
        """Position ids of one expanded sequence `ids` [L]: [3, L] mrope over its images, else [L]."""
        if self.spec is None:
            return text_position_ids(len(ids))
        grid = self.preparer.grid_thw([(img.height, img.width) for img in images]) if images else None
        return mrope_position_ids(ids, grid, None, **self.spec.rope_kwargs())
