"""Build a complete, tiny Hugging Face model folder offline: config, random weights, a locally
trained BPE tokenizer with the Qwen special tokens, a chat template, image and video processors.

    python -m vlrl.models.tiny OUT_DIR --arch qwen2_5_vl [--size tiny|small] [--seed 0]

The folder loads unchanged with `AutoProcessor` / `AutoModelForImageTextToText` (or
`AutoModelForCausalLM` for text-only archs) and with `vllm.LLM`. Tests and the quickstart use
it because nothing can be downloaded here. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlrl.models.families.idefics3 import IMAGE_TOKENS as IDEFICS3_IMAGE_TOKENS

VISION_ARCHS = (
    "qwen2_5_vl",
    "qwen2_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "internvl",
    "idefics3",
    "smolvlm",
    "glm4v",
)
TEXT_ARCHS = ("qwen2", "qwen3")
ARCHS = (*VISION_ARCHS, *TEXT_ARCHS)
QWEN3_VL_PROCESSOR_ARCHS = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5")  # one processor, patch 16
# Mixture-of-experts text decoder of the `qwen3_vl_moe` arch: every layer sparse, top-k routing.
MOE_EXPERTS, MOE_TOP_K = 4, 2

# Qwen's special tokens; the ids follow the order here, right after the trained vocabulary.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# InternVL's image brackets and placeholder, named for its processor (`extra_special_tokens`).
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}  # fmt: skip
INTERNVL_TILE, INTERNVL_TOKENS_PER_TILE = 56, 4  # 4x4 patches of 14, pixel-shuffled 2x2 -> 4 tokens
# Idefics3's and SmolVLM's: image brackets, placeholder, tile tokens, and the end of a turn (the
# processor requires it; our template ends turns with <|im_end|>). Tiles as InternVL's; an image's
# longest side is resized to two tiles: 2x2 tiles (or 1x2, 2x1) and the global view.
IDEFICS3_ARCHS = ("idefics3", "smolvlm")
IDEFICS3_TOKENS = (*IDEFICS3_IMAGE_TOKENS, "<end_of_utterance>")
# GLM-4.1V's image and video brackets and placeholders (its processor's names).
GLM4V_TOKENS = ("<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|video|>",
                "<|end_of_video|>")  # fmt: skip
IMAGE_PLACEHOLDERS = {"internvl": "<IMG_CONTEXT>", "idefics3": "<image>", "smolvlm": "<image>",
                      "glm4v": "<|begin_of_image|><|image|><|end_of_image|>"}  # fmt: skip
VIDEO_PLACEHOLDERS = {"glm4v": "<|begin_of_video|><|video|><|end_of_video|>"}

# Our own chat template (Qwen-style turns). Message content is a string or a list of parts
# {"type": "text", "text": ...} / {"type": "image"} / {"type": "video"}. Unlike Qwen's, it adds no
# default system turn: a tiny model attends more to the image when the prompt is short.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinySize:
    hidden: int
    layers: int
    heads: int  # head_dim = hidden // heads; vLLM's CPU attention needs head_dim >= 32
    kv_heads: int
    intermediate: int
    vision_hidden: int
    vision_depth: int
    vocab: int


SIZES = {
    # ~1 M parameters: the quickstart and most tests.
    "tiny": TinySize(128, 2, 2, 2, 256, 128, 2, 1024),
    # ~30 M parameters: rollout and actor benchmarks.
    "small": TinySize(512, 6, 8, 4, 1408, 256, 2, 8192),
}


# Tool-call JSON the multi-turn demo and tests write; in the corpus only with `tool_tokens=True`, so
# a call is ~8 tokens (`{"`, `name`, `":`, ...) instead of ~17 single characters.
TOOL_CALL_TEXTS = ('{"name": "reveal"}', '{"name": "reveal", "arguments": {}}')


def _corpus(tool_tokens: bool = False) -> list[str]:
    """Text to train the BPE on: the words our synthetic tasks, prompts and rewards use (and, with
    `tool_tokens`, the tool-call JSON)."""
    colours = "red green blue yellow purple orange black white pink brown gray cyan".split()
    shapes = "circle square triangle star ellipse rectangle shape shapes".split()
    words = (
        "what which how many is the of a an in image picture colour color shape count answer "
        "question one word with only please think step by reasoning final put your within boxed "
        "there are you assistant user system helpful and then first solve problem number value "
        "yes no true false left right top bottom big small largest smallest total sum"
    ).split()
    lines = [" ".join(p) for p in itertools.product(colours, shapes)]
    lines += [" ".join(words[i : i + 7]) for i in range(0, len(words), 3)]
    lines += [f"{a} + {b} = {a + b}" for a in range(12) for b in range(12)]
    lines += ["<think> reasoning </think> <answer> 42 </answer>", "\\boxed{\\frac{1}{2}} x^2 + y^2 = z^2"]
    lines += [" ".join(map(str, range(k, k + 10))) for k in range(0, 100, 10)]
    if tool_tokens:
        lines += list(TOOL_CALL_TEXTS)
    return lines * 4


# Qwen2.5/3's tool-call markers, added (not special: they survive decoding) with `tool_tokens=True`.
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
# Reasoning-format tags as single tokens (Qwen3's tokenizers have <think> and </think> so), added
# with `reasoning_tokens=True`: a tiny model learns an answer format made of a few symbols far
# faster than one spelled out in characters.
REASONING_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")


def chat_template(arch: str) -> str:
    """`CHAT_TEMPLATE` with the arch's image and video placeholders."""
    if arch not in IMAGE_PLACEHOLDERS:
        return CHAT_TEMPLATE
    return CHAT_TEMPLATE.replace(
        "<|vision_start|><|image_pad|><|vision_end|>", IMAGE_PLACEHOLDERS[arch]
    ).replace("<|vision_start|><|video_pad|><|vision_end|>", VIDEO_PLACEHOLDERS.get(arch, "<video>"))


def build_tokenizer(
    vocab_size: int, tool_tokens: bool = False, reasoning_tokens: bool = False, arch: str = "qwen2_5_vl"
):
    """A byte-level BPE trained on `_corpus()`, with the Qwen special tokens appended (then, with
    `tool_tokens` / `reasoning_tokens`, the tool-call markers / reasoning tags as more tokens: the
    trained vocabulary is unchanged; for InternVL, its image tokens last)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(tool_tokens), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tool_tokens:
        tok.add_tokens(list(TOOL_TOKENS))
    if reasoning_tokens:
        tok.add_tokens(list(REASONING_TOKENS))
    extra = INTERNVL_TOKENS if arch == "internvl" else {}
    arch_tokens = {"glm4v": GLM4V_TOKENS, **dict.fromkeys(IDEFICS3_ARCHS, IDEFICS3_TOKENS)}.get(arch, ())
    tok.add_special_tokens(list(extra.values()) + list(arch_tokens))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=32768,
        chat_template=chat_template(arch),
        **({"extra_special_tokens": extra} if extra else {}),
    )
    return fast


def _token_ids(tokenizer) -> dict[str, int]:
    names = (*SPECIAL_TOKENS, *INTERNVL_TOKENS.values(), "<image>", *GLM4V_TOKENS)
    return {t: tokenizer.convert_tokens_to_ids(t) for t in names}


def build_config(arch: str, size: TinySize, vocab_size: int, ids: dict[str, int]):
    """A transformers config for `arch` with the tiny dimensions and our token ids."""
    from transformers import AutoConfig

    head_dim = size.hidden // size.heads
    text: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    if arch in TEXT_ARCHS:
        if arch == "qwen3":  # Qwen3 sets head_dim itself (and normalises q and k per head)
            text["head_dim"] = head_dim
        return AutoConfig.for_model(arch, **text, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if arch == "internvl":  # InternViT + pixel-shuffle projector + a Qwen2 text model
        text.update(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        vision = dict(hidden_size=size.vision_hidden // 2, num_hidden_layers=size.vision_depth, num_attention_heads=2,
                      intermediate_size=size.vision_hidden, image_size=[INTERNVL_TILE] * 2, patch_size=[14, 14])  # fmt: skip
        return AutoConfig.for_model(arch, text_config=text, vision_config=vision, image_token_id=ids["<IMG_CONTEXT>"],
                                    image_seq_length=INTERNVL_TOKENS_PER_TILE, downsample_ratio=0.5,
                                    tie_word_embeddings=False)  # fmt: skip
    if arch in IDEFICS3_ARCHS:  # SigLIP-style tower + pixel-shuffle connector + a Llama text model
        text.update(model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
        vision = dict(hidden_size=size.vision_hidden // 2, intermediate_size=size.vision_hidden,
                      num_hidden_layers=size.vision_depth, num_attention_heads=2, image_size=INTERNVL_TILE, patch_size=14)  # fmt: skip
        return AutoConfig.for_model(arch, text_config=text, vision_config=vision, image_token_id=ids["<image>"],
                                    scale_factor=2, pad_token_id=text["pad_token_id"], tie_word_embeddings=False)  # fmt: skip
    if arch == "glm4v":
        return _glm4v_config(size, text, ids)
    # mrope splits the rotary frequencies (half the rotated dims) over (temporal, height, width).
    # Qwen3.5 rotates a quarter of each head (`partial_rotary_factor`).
    rotary = head_dim // 4 if arch == "qwen3_5" else head_dim
    half = rotary // 2
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": section}
    vision_ids = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    vh, vd, vheads = size.vision_hidden, size.vision_depth, size.vision_hidden // 64
    if arch == "qwen2_5_vl":
        vision = dict(depth=vd, hidden_size=vh, intermediate_size=2 * vh, num_heads=vheads, out_hidden_size=size.hidden,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[vd - 1])  # fmt: skip
    elif arch == "qwen2_vl":
        vision = dict(depth=vd, embed_dim=vh, hidden_size=size.hidden, num_heads=vheads, mlp_ratio=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    elif arch == "qwen3_5":
        # Linear-attention (gated delta rule) layers, then one full-attention layer, as in Qwen3.5's
        # 3:1 pattern. vLLM 0.32's CPU gated-delta-rule kernel refuses a key head dim of 32
        # ("Unexpected head dim size"); 64 runs (the real models use 128).
        rope.update(mrope_interleaved=True, partial_rotary_factor=0.25)
        text.update(head_dim=head_dim, linear_conv_kernel_dim=4, linear_key_head_dim=64,
                    linear_value_head_dim=64, linear_num_key_heads=size.heads,
                    linear_num_value_heads=2 * size.heads,
                    layer_types=["linear_attention"] * (size.layers - 1) + ["full_attention"])  # fmt: skip
        vision = dict(depth=vd, hidden_size=vh, intermediate_size=2 * vh, num_heads=vheads, out_hidden_size=size.hidden,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=144)  # fmt: skip
    else:  # qwen3_vl, qwen3_vl_moe
        rope["mrope_interleaved"] = True
        text["head_dim"] = head_dim
        if arch == "qwen3_vl_moe":
            # Expert width 3/4 of hidden: a multiple of 32 (vLLM's CPU MoE kernel), and neither it
            # nor twice it equals hidden, so no expert tensor is square: transformers tells the
            # two expert layouts apart by shape (vlrl.models.moe).
            text.update(num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K,
                        moe_intermediate_size=3 * size.hidden // 4, decoder_sparse_step=1,
                        norm_topk_prob=True)  # fmt: skip
            # norm_topk_prob: not a transformers 5.19 field (its router always renormalizes the
            # top-k weights) but Qwen's configs carry it and vLLM 0.32 reads it.
        vision = dict(depth=vd, hidden_size=vh, intermediate_size=2 * vh, num_heads=vheads, out_hidden_size=size.hidden,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=144,
                      deepstack_visual_indexes=[vd - 1])  # fmt: skip
    text["rope_parameters"] = rope
    return AutoConfig.for_model(
        arch, text_config=text, vision_config=vision, **vision_ids, tie_word_embeddings=False
    )


def _glm4v_config(size: TinySize, text: dict[str, Any], ids: dict[str, int]):
    """GLM-4.1V: its vision tower (patch 14, merge 2) and a GLM-4 decoder rotating half of each
    head by mrope (sections over the 16 rotated pairs of a 64-wide head, as 8/12/12 of 32 in the
    real model)."""
    from transformers import AutoConfig

    rope = {
        "rope_type": "default",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.5,
        "mrope_section": [4, 6, 6],
    }
    # attention_bias: transformers always gives q/k/v a bias; vLLM 0.32 (glm4.py) builds it only when
    # the config says so, as the released configs do.
    text.update(model_type="glm4v_text", rope_parameters=rope, attention_bias=True)
    vision = dict(depth=size.vision_depth, hidden_size=size.vision_hidden // 2, intermediate_size=size.hidden,
                  num_heads=2, out_hidden_size=size.hidden, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, image_size=56)  # fmt: skip
    names = ("image_start_token_id", "image_token_id", "image_end_token_id", "video_start_token_id",
             "video_token_id", "video_end_token_id")  # fmt: skip
    brackets = {name: ids[token] for name, token in zip(names, GLM4V_TOKENS)}
    return AutoConfig.for_model(
        "glm4v", text_config=text, vision_config=vision, **brackets, tie_word_embeddings=False
    )


def build_processor(arch: str, tokenizer, min_pixels: int, max_pixels: int):
    """Image + video processors and the multimodal processor for `arch`."""
    from transformers import AutoProcessor  # noqa: F401  (registers processor classes)

    if arch == "internvl":  # tiles of INTERNVL_TILE pixels: up to 4 plus a thumbnail
        from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

        tile = {"height": INTERNVL_TILE, "width": INTERNVL_TILE}
        image = GotOcr2ImageProcessor(size=tile, crop_to_patches=True, min_patches=1, max_patches=4)
        return InternVLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=InternVLVideoProcessor(size=tile),
                                 image_seq_length=INTERNVL_TOKENS_PER_TILE, chat_template=chat_template(arch))  # fmt: skip

    if arch in IDEFICS3_ARCHS:
        return _idefics3_processor(arch, tokenizer)
    if arch == "glm4v":  # its pixel bounds count t x h x w with t = 2 (one image = two frames)
        from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

        pixels = {"shortest_edge": 2 * min_pixels, "longest_edge": 2 * max_pixels}
        image = Glm4vImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2, size=pixels)
        video = Glm4vVideoProcessor(patch_size=14, merge_size=2, temporal_patch_size=2)
        return Glm4vProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video,
                              chat_template=chat_template(arch))  # fmt: skip
    if arch in QWEN3_VL_PROCESSOR_ARCHS:
        from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

        patch, processor_cls, video_cls = 16, Qwen3VLProcessor, Qwen3VLVideoProcessor
    else:
        from transformers import (
            Qwen2_5_VLProcessor,
            Qwen2VLImageProcessor,
            Qwen2VLProcessor,
            Qwen2VLVideoProcessor,
        )

        patch, video_cls = 14, Qwen2VLVideoProcessor
        processor_cls = Qwen2_5_VLProcessor if arch == "qwen2_5_vl" else Qwen2VLProcessor
    pixels = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image = Qwen2VLImageProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2, size=pixels)
    video = video_cls(patch_size=patch, merge_size=2, temporal_patch_size=2, size=pixels)
    return processor_cls(
        image_processor=image, tokenizer=tokenizer, video_processor=video, chat_template=CHAT_TEMPLATE
    )


def _idefics3_processor(arch: str, tokenizer):
    """Idefics3's (or SmolVLM's) processor: images to two tiles on the longest side, plus the global view."""
    import transformers

    prefix = "SmolVLM" if arch == "smolvlm" else "Idefics3"
    sizes = {"size": {"longest_edge": 2 * INTERNVL_TILE}, "max_image_size": {"longest_edge": INTERNVL_TILE}}
    parts = {
        "image_processor": getattr(transformers, f"{prefix}ImageProcessor")(**sizes),
        "tokenizer": tokenizer,
    }
    if arch == "smolvlm":
        parts["video_processor"] = transformers.SmolVLMVideoProcessor(**sizes)
    processor_cls = getattr(transformers, f"{prefix}Processor")
    return processor_cls(**parts, image_seq_len=INTERNVL_TOKENS_PER_TILE, chat_template=chat_template(arch))


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen2_5_vl",
    size: str = "tiny",
    seed: int = 0,
    min_pixels: int = 28 * 28 * 4,
    max_pixels: int = 28 * 28 * 64,
    tool_tokens: bool = False,
    reasoning_tokens: bool = False,
) -> Path:
    """Write a loadable model folder for `arch` into `out_dir` and return its path.

    `tool_tokens`: add `<tool_call>` / `</tool_call>` as single tokens (multi-turn rollouts);
    `reasoning_tokens`: add `<think>`, `</think>`, `<answer>`, `</answer>` as single tokens."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    from vlrl.models.moe import write_checkpoint_layout

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dims = SIZES[size]
    tokenizer = build_tokenizer(dims.vocab, tool_tokens, reasoning_tokens, arch)
    ids = _token_ids(tokenizer)
    config = build_config(arch, dims, len(tokenizer), ids)
    torch.manual_seed(seed)
    model_cls = AutoModelForCausalLM if arch in TEXT_ARCHS else AutoModelForImageTextToText
    model = model_cls.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
    )
    model.save_pretrained(out)
    # MoE: experts in Qwen's checkpoint layout, like a real Qwen3-VL-MoE folder (vLLM reads only it).
    write_checkpoint_layout(out, config)
    if arch in VISION_ARCHS:
        build_processor(arch, tokenizer, min_pixels, max_pixels).save_pretrained(out)
    else:
        tokenizer.save_pretrained(out)
    options = {"tool_tokens": tool_tokens, "reasoning_tokens": reasoning_tokens}
    info = {"arch": arch, "size": size, "seed": seed, **{k: True for k, v in options.items() if v}}
    (out / "vlrl_tiny.json").write_text(json.dumps(info))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="qwen2_5_vl", choices=ARCHS)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = build_tiny_model(args.out_dir, args.arch, args.size, args.seed)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        n_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open is not a dict)
    print(f"wrote {args.arch} ({args.size}, {n_params / 1e6:.2f} M parameters) to {out}")


if __name__ == "__main__":
    main()
