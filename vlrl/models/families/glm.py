"""GLM-4.1V (`Glm4vForConditionalGeneration`, model_type "glm4v"): a vision tower of Qwen2-VL's
shape (patch 14, temporal patch 2, 2x2 merge, `model.visual`) and a GLM-4 decoder rotating part of
each head by mrope.

For images its processor and position rule are Qwen2-VL's: `<|image|>` repeated grid / 4 times
between `<|begin_of_image|>` and `<|end_of_image|>`; positions (t, h, w) from the block's start,
the next token at max + 1 (transformers 5.19's `Glm4vModel.get_rope_index`; vLLM 0.32's
glm4_1v.py). Two differences vlrl follows: the brackets' names, and pixel bounds that count an
image as two frames (`smart_resize` of image_processing_glm4v.py bounds t x h x w). Videos differ
(one block per frame with a timestamp between frames) and are not supported yet.
"""

from __future__ import annotations

from vlrl.models.families import GATES, Family

GLM4V = Family(
    name="glm4v",
    model_types=("glm4v",),
    vision=True,
    processor_prefixes=("Glm4v",),
    positions="mrope",
    vision_scheme="qwen2_vl",
    vision_start_token="<|begin_of_image|>",
    config_token_keys=(
        ("vision_start_token_id", "image_start_token_id"),
        ("vision_end_token_id", "image_end_token_id"),
    ),
    videos=False,
    processor_bounds_span_time=True,
    vision_flops=False,
    shared_image_encoding=False,
    banned_tokens=(
        "<|begin_of_image|>",
        "<|image|>",
        "<|end_of_image|>",
        "<|begin_of_video|>",
        "<|video|>",
        "<|end_of_video|>",
    ),  # fmt: skip
    # transformers 5.19 always gives q/k/v a bias (Glm4vTextAttention); vLLM 0.32 builds it only
    # when the config says so (glm4.py) and otherwise drops the biases it is given without a word:
    # the weight_sync gate found it (a gap of 1e-3 after the sync).
    text_config_requirements=(
        (
            "attention_bias",
            True,
            "transformers always adds q/k/v biases; vLLM 0.32 builds them only when this is set",
        ),
    ),
    tiny_arch="glm4v",
    gates=tuple(GATES),
)
