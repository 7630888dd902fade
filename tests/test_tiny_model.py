"""The tiny-model builder writes folders that transformers and vLLM load unchanged."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlrl.models.tiny import ARCHS, INTERNVL_TOKENS_PER_TILE, SPECIAL_TOKENS, VISION_ARCHS, build_tiny_model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch=arch) for arch in ARCHS}


def _inputs(arch: str, path: Path):
    from transformers import AutoProcessor, AutoTokenizer

    if arch in VISION_ARCHS:
        processor = AutoProcessor.from_pretrained(path)
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it"}]}
        ]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        image = Image.new("RGB", (56, 84), (255, 0, 0))
        return processor.tokenizer, text, processor(text=[text], images=[image], return_tensors="pt")
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what colour"}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer, text, tokenizer(text, return_tensors="pt")


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_round_trip(tiny_dirs: dict[str, Path], arch: str) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = tiny_dirs[arch]
    tokenizer, text, enc = _inputs(arch, path)
    # The chat template keeps Qwen's turn layout, newlines included.
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert all(tokenizer.convert_tokens_to_ids(t) != tokenizer.unk_token_id for t in SPECIAL_TOKENS)
    cls = AutoModelForImageTextToText if arch in VISION_ARCHS else AutoModelForCausalLM
    model = cls.from_pretrained(path).eval()
    n_pad = (enc["input_ids"] == getattr(model.config, "image_token_id", -1)).sum().item()
    if arch == "internvl":
        # 56x84 -> 2 tiles of 56 plus a thumbnail (crop to patches), 4 context tokens each
        assert enc["pixel_values"].shape[0] == 3 and n_pad == 3 * INTERNVL_TOKENS_PER_TILE
    elif arch in ("idefics3", "smolvlm"):
        # 56x84 -> longest side 112 (two tiles): 2x2 tiles of 56 plus the global view, 4 tokens each
        assert enc["pixel_values"].shape[:2] == (1, 5) and n_pad == 5 * INTERNVL_TOKENS_PER_TILE
    elif arch in VISION_ARCHS:
        # a 56x84 image = 4x6 patches of 14 (or 16 -> resized), merged 2x2: the pads match the grid
        grid = enc["image_grid_thw"][0]
        assert n_pad == int(grid.prod()) // 4
    logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > enc["input_ids"].shape[1]


def test_deterministic_for_a_seed(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = load_file(build_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(build_tiny_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(build_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    assert json.loads((tmp_path / "a" / "vlrl_tiny.json").read_text())["seed"] == 3


def test_chat_template_adds_no_system_turn_but_renders_a_given_one(tiny_dirs: dict[str, Path]) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_dirs["qwen2_5_vl"])
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}
    plain = processor.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    assert plain == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>colour?<|im_end|>\n<|im_start|>assistant\n"
    )
    system = {"role": "system", "content": "Be brief."}
    with_system = processor.apply_chat_template([system, user], tokenize=False, add_generation_prompt=True)
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n" + plain


def test_unknown_arch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch 'llava'"):
        build_tiny_model(tmp_path, arch="llava")


@pytest.mark.slow
def test_vllm_generates_with_an_image(tiny_dirs: dict[str, Path]) -> None:
    from vllm import LLM

    llm = LLM(model=str(tiny_dirs["qwen2_5_vl"]), dtype="bfloat16", enforce_eager=True, max_model_len=512,
              limit_mm_per_prompt={"image": 1}, gpu_memory_utilization=0.2, seed=0)  # fmt: skip
    try:
        _generate_with_an_image(llm)
    finally:  # the LLM set up a torch.distributed world in this process: later tests start their own
        _tear_down_world()


def _tear_down_world() -> None:
    import torch.distributed as dist
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()


def _generate_with_an_image(llm) -> None:
    from vllm import SamplingParams

    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what colour<|im_end|>\n<|im_start|>assistant\n"
    image = Image.new("RGB", (56, 56), (0, 0, 255))
    outputs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}] * 2,
                           SamplingParams(max_tokens=6, temperature=1.0))  # fmt: skip
    assert len(outputs) == 2
    assert all(len(o.outputs[0].token_ids) > 0 for o in outputs)
    # the engine expanded the single image pad into the image's tokens (56x56 -> 2x2 merged = 4)
    assert len(outputs[0].prompt_token_ids) == len(llm.get_tokenizer().encode(prompt)) + 3


def test_tool_tokens_make_the_demo_call_short_and_leave_the_default_vocabulary_alone() -> None:
    from vlrl.models.tiny import SIZES, TOOL_CALL_TEXTS, build_tokenizer

    plain = build_tokenizer(SIZES["tiny"].vocab)
    tools = build_tokenizer(SIZES["tiny"].vocab, tool_tokens=True)
    call = "<tool_call>" + TOOL_CALL_TEXTS[0] + "</tool_call>"
    # a sampled call must survive temperature 1: ~8 tokens, not 17 single characters
    assert len(tools.encode(call, add_special_tokens=False)) <= 8
    assert len(plain.encode(TOOL_CALL_TEXTS[0], add_special_tokens=False)) > 12
    assert tools.decode(tools.encode(call, add_special_tokens=False)) == call
    # default models (all other tests and recipes) keep their exact vocabulary
    plain_again = build_tokenizer(SIZES["tiny"].vocab)
    assert plain.get_vocab() == plain_again.get_vocab() and len(plain) == 629


def test_moe_folder_holds_qwen_expert_layout_and_passes_the_engine_check(tiny_dirs: dict[str, Path]) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig

    from vlrl.models.moe import check_engine_config, is_sparse_layer

    config = AutoConfig.from_pretrained(tiny_dirs["qwen3_vl_moe"])
    text = config.text_config
    assert (text.num_experts, text.num_experts_per_tok) == (4, 2)
    assert all(is_sparse_layer(text, i) for i in range(text.num_hidden_layers))
    with safe_open(str(tiny_dirs["qwen3_vl_moe"] / "model.safetensors"), framework="pt") as f:
        gate_up = f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()
        down = f.get_slice("model.language_model.layers.0.mlp.experts.down_proj").get_shape()
    inter = text.moe_intermediate_size
    assert gate_up == [4, text.hidden_size, 2 * inter] and down == [4, inter, text.hidden_size]
    check_engine_config(config)
    text.norm_topk_prob = False
    with pytest.raises(ValueError, match="norm_topk_prob"):
        check_engine_config(config)
    check_engine_config(AutoConfig.from_pretrained(tiny_dirs["qwen3_vl"]))  # dense: nothing to check


def test_reasoning_tags_are_single_tokens(tmp_path: Path) -> None:
    """`reasoning_tokens=True` adds the tags as tokens after the trained vocabulary (unchanged)."""
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "plain", arch="qwen3"))
    tagged = AutoTokenizer.from_pretrained(
        build_tiny_model(tmp_path / "tagged", arch="qwen3", reasoning_tokens=True)
    )
    text = "<think> 1 + 1 </think><answer>2</answer>"
    ids = tagged(text)["input_ids"]
    assert [tagged.decode([i]) for i in ids if i >= len(plain)] == [
        "<think>",
        "</think>",
        "<answer>",
        "</answer>",
    ]
    assert tagged("red circle")["input_ids"] == plain("red circle")["input_ids"]
    assert tagged.decode(ids) == text
