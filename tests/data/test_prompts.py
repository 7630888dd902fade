"""Format templates (sandboxed), message splitting, chat templates, processor loading."""

from __future__ import annotations

import pytest

from vlrl.data.prompts import (
    ChatFormatter,
    FormatPrompt,
    PromptTemplateError,
    expand_image_tokens,
    user_message,
)
from vlrl.models.processor import (
    load_processor,
    model_family,
    mrope_kwargs,
    resolve_chat_template,
    vision_spec,
    vision_token_ids,
)


def test_format_prompt_renders_content(tmp_path):
    path = tmp_path / "fmt.jinja"
    path.write_text("{{ content | trim }} Put the answer in \\boxed{}.")
    assert (
        FormatPrompt(str(path)).render("  <image>What colour? ")
        == "<image>What colour? Put the answer in \\boxed{}."
    )


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ content.__class__.__base__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{% set x = [] %}{{ x.append(1) }}",  # mutation is refused by the immutable sandbox
    ],
)
def test_sandbox_refuses_unsafe_templates(tmp_path, source):
    path = tmp_path / "evil.jinja"
    path.write_text(source)
    with pytest.raises(
        PromptTemplateError, match=r"evil.jinja' failed at line 1 \((SecurityError|UndefinedError)\)"
    ):
        FormatPrompt(str(path)).render("hi")


def test_template_errors_give_the_line(tmp_path):
    (tmp_path / "syntax.jinja").write_text("Question:\n{{ content | trim }\nAnswer.")
    with pytest.raises(
        PromptTemplateError, match=r"syntax.jinja' is not a valid Jinja template: line 2: unexpected '}'"
    ):
        FormatPrompt(str(tmp_path / "syntax.jinja"))
    (tmp_path / "typo.jinja").write_text("Question:\n\n{{ contnet }}\n")
    with pytest.raises(
        PromptTemplateError, match=r"typo.jinja' failed at line 3 \(UndefinedError\): 'contnet' is undefined"
    ):
        FormatPrompt(str(tmp_path / "typo.jinja")).render("hi")


def test_format_prompt_errors(tmp_path):
    with pytest.raises(PromptTemplateError, match="cannot be read"):
        FormatPrompt(str(tmp_path / "missing.jinja"))
    (tmp_path / "bad.jinja").write_text("{% if %}")
    with pytest.raises(PromptTemplateError, match="not a valid Jinja template"):
        FormatPrompt(str(tmp_path / "bad.jinja"))
    (tmp_path / "typo.jinja").write_text("{{ contnet }}")
    with pytest.raises(PromptTemplateError, match="UndefinedError"):
        FormatPrompt(str(tmp_path / "typo.jinja")).render("x")


def test_user_message_splits_markers_in_order():
    (message,) = user_message("Compare <image>and<image> please", multimodal=True)
    assert message["role"] == "user"
    assert message["content"] == [
        {"type": "text", "text": "Compare "},
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
        {"type": "text", "text": " please"},
    ]
    assert user_message("<image>", multimodal=True)[0]["content"] == [{"type": "image"}]
    assert user_message("plain", multimodal=False) == [{"role": "user", "content": "plain"}]


def test_chat_template_and_override(tokenizer_processor, tmp_path):
    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    prompt = ChatFormatter(tokenizer, processor)("<image>hi")
    assert prompt.endswith("<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n")
    override = "{% for m in messages %}U:{% for p in m['content'] %}{{ p.get('text', '[img]') }}{% endfor %}{% endfor %}A:"
    assert ChatFormatter(tokenizer, processor, override)("<image>hi") == "U:[img]hiA:"
    (tmp_path / "chat.jinja").write_text(override)
    assert resolve_chat_template(str(tmp_path / "chat.jinja")) == override
    with pytest.raises(FileNotFoundError, match="chat template file"):
        resolve_chat_template(str(tmp_path / "nope.jinja"))


def test_expand_image_tokens():
    assert expand_image_tokens([1, 9, 2, 9], 9, [2, 3]) == [1, 9, 9, 2, 9, 9, 9]
    with pytest.raises(ValueError, match="2 image placeholder tokens for 1 images"):
        expand_image_tokens([9, 9], 9, [4])


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_load_processor_vl(tiny_model, arch):
    from transformers import AutoConfig

    tokenizer, processor = load_processor(str(tiny_model(arch)), override_chat_template="{{ 'X' }}")
    assert processor is not None and tokenizer is processor.tokenizer
    assert tokenizer.chat_template == processor.chat_template == "{{ 'X' }}"
    config = AutoConfig.from_pretrained(tiny_model(arch))
    assert model_family(config) == arch
    ids = vision_token_ids(config)
    assert ids["image_token_id"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    spec = vision_spec(processor)
    assert spec.family == arch and spec.factor == (32 if arch == "qwen3_vl" else 28)
    assert spec.rope_kwargs() | {"tokens_per_second": 0} == mrope_kwargs(config) | {"tokens_per_second": 0}


def test_load_processor_text_model(tiny_model):
    from transformers import AutoConfig

    tokenizer, processor = load_processor(str(tiny_model("qwen2")))
    assert processor is None and tokenizer.pad_token_id is not None
    config = AutoConfig.from_pretrained(tiny_model("qwen2"))
    assert model_family(config) == "text" and model_family({"model_type": "llama"}) == "text"
    with pytest.raises(ValueError, match="has no image_token_id"):
        vision_token_ids(config)
