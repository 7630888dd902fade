"""Prompt text: the user's format template, `<image>` splitting, the chat template, placeholder expansion.

row text --format_prompt (sandboxed Jinja, variable `content`)--> text with <image> markers
--split--> one user message [{"type": "image"}, {"type": "text", "text": ...}, ...]
--chat template (add_generation_prompt=True)--> prompt string with one <|image_pad|> per image
--tokenize--> raw ids (for vLLM) --expand each <|image_pad|> to its token count--> model ids
"""

from __future__ import annotations

import re
import traceback
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vlrl.models.processor import resolve_chat_template

MARKER_RE = re.compile(r"(<image>|<video>)")


class PromptTemplateError(ValueError):
    """The format template cannot be loaded or rendering it failed (including sandbox violations)."""


class FormatPrompt:
    """A `data.format_prompt` Jinja file rendered in a sandbox with the variable `content`.

    The sandbox refuses access to private attributes (`__class__`, `__globals__` ...) and mutation
    of objects, so a template cannot reach Python internals; undefined variables are errors.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except OSError as err:
            raise PromptTemplateError(f"format_prompt {path!r} cannot be read: {err}") from err
        env = ImmutableSandboxedEnvironment(keep_trailing_newline=False, undefined=jinja2.StrictUndefined)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise PromptTemplateError(
                f"format_prompt {path!r} is not a valid Jinja template: line {err.lineno}: {err.message}"
            ) from err
        except jinja2.TemplateError as err:
            raise PromptTemplateError(f"format_prompt {path!r} is not a valid Jinja template: {err}") from err

    def render(self, content: str) -> str:
        """The template applied to `content` (raises PromptTemplateError)."""
        try:
            return self.template.render(content=content)
        except jinja2.TemplateError as err:  # SecurityError, UndefinedError, ... all derive from it
            kind = type(err).__name__
            line = _template_line(err)
            where = f" at line {line}" if line is not None else ""
            raise PromptTemplateError(f"format_prompt {self.path!r} failed{where} ({kind}): {err}") from err


def _template_line(err: BaseException) -> int | None:
    """Template line of a rendering error (Jinja rewrites tracebacks so the template's frames are
    named `<template>`); None when not found."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == "<template>"]
    return frames[-1].lineno if frames else None


def count_markers(text: str) -> tuple[int, int]:
    """(number of `<image>` markers, number of `<video>` markers) in `text`."""
    return text.count("<image>"), text.count("<video>")


def user_message(text: str, multimodal: bool) -> list[dict[str, Any]]:
    """One user chat message. Multimodal: content parts in marker order; text models: plain string."""
    if not multimodal:
        return [{"role": "user", "content": text}]
    parts: list[dict[str, Any]] = []
    for piece in MARKER_RE.split(text):
        if piece == "<image>":
            parts.append({"type": "image"})
        elif piece == "<video>":
            parts.append({"type": "video"})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return [{"role": "user", "content": parts}]


class ChatFormatter:
    """Applies the chat template: `data.override_chat_template`, else the processor's, else the tokenizer's."""

    def __init__(
        self,
        tokenizer: Any,
        processor: Any | None,
        override: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None  # function schemas for the template's tools section (multi-turn)
        template = resolve_chat_template(override)
        if template is None and processor is not None:
            template = getattr(processor, "chat_template", None)
        self.template = template or tokenizer.chat_template
        if self.template is None:
            raise PromptTemplateError("the tokenizer has no chat template; set data.override_chat_template")
        self.multimodal = processor is not None

    def __call__(self, text: str) -> str:
        """The prompt string for the user text (with a generation prompt for the assistant)."""
        return self.tokenizer.apply_chat_template(
            user_message(text, self.multimodal),
            chat_template=self.template,
            add_generation_prompt=True,
            tokenize=False,
            **({"tools": self.tools} if self.tools else {}),
        )


def expand_image_tokens(raw_ids: list[int], image_token_id: int, tokens_per_image: list[int]) -> list[int]:
    """Replace the k-th `image_token_id` in `raw_ids` with `tokens_per_image[k]` copies.

    Equivalent to tokenizing the expanded text (a special token is never merged with its
    neighbours), and much cheaper; a test checks it against the processor's own expansion.
    """
    found = raw_ids.count(image_token_id)
    if found != len(tokens_per_image):
        raise ValueError(f"prompt has {found} image placeholder tokens for {len(tokens_per_image)} images")
    out: list[int] = []
    counts = iter(tokens_per_image)
    for token in raw_ids:
        if token == image_token_id:
            out.extend([image_token_id] * next(counts))
        else:
            out.append(token)
    return out


def expand_video_tokens(raw_ids: list[int], video_token_id: int, per_video: list[list[int]]) -> list[int]:
    """Replace the k-th `video_token_id` in `raw_ids` with the ids `per_video[k]` (the processor's
    text for that video, tokenized: video tokens, and for Qwen3-VL frame timestamps)."""
    found = raw_ids.count(video_token_id)
    if found != len(per_video):
        raise ValueError(f"prompt has {found} video placeholder tokens for {len(per_video)} videos")
    out: list[int] = []
    videos = iter(per_video)
    for token in raw_ids:
        out.extend(next(videos) if token == video_token_id else [token])
    return out
