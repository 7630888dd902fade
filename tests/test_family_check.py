"""Every model family with a tiny builder passes the conformance gates its record lists
(`python -m vlrl.tools.family_check`), a gate can fail, and the trainer refuses what a family
cannot do at start-up."""

from __future__ import annotations

import dataclasses

import pytest

from vlrl.config import PPOConfig
from vlrl.models.families import FAMILIES, GATES, family_errors, family_of
from vlrl.models.families.qwen import QWEN3_5
from vlrl.models.tiny import VISION_ARCHS

# One tiny arch per family: every vision arch is a family of its own; qwen2 gates `text` (qwen3 is
# another text model).
GATED_ARCHS = (*VISION_ARCHS, "qwen2")


def test_every_family_with_a_tiny_builder_is_gated_here():
    assert {family_of({"model_type": arch}).name for arch in GATED_ARCHS} == set(FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("arch", GATED_ARCHS)
def test_family_passes_every_gate_its_record_lists(arch, tmp_path):
    from vlrl.tools.family_check import FamilyCheck, one_rank_world

    with one_rank_world():
        check = FamilyCheck(arch, tmp_path)
        try:
            results = check.run(list(GATES))
            if arch == "qwen3_5":  # its record says padded: a record claiming packing fails the gate
                check.family = dataclasses.replace(QWEN3_5, packing="packed")
                packed = check.packing()
        finally:
            check.close()
    lines = "\n".join(r.line() for r in results)
    assert [r.gate for r in results] == list(GATES), lines
    assert all(r.passed for r in results), lines
    assert set(family_of({"model_type": arch}).gates) == set(GATES)
    if arch == "qwen3_5":
        # the gated-delta-rule layers leak state across packed rows on CPU
        assert not packed.passed and "packed vs padded" in packed.detail, packed.line()


def _config(**actor: object) -> PPOConfig:
    config = PPOConfig()
    for key, value in actor.items():
        setattr(config.worker.actor, key, value)
    config.trainer.device = "cpu"
    return config


def test_start_up_refuses_what_a_family_cannot_do():
    config = _config()
    config.worker.rollout.dtype = "fp32"
    errors = family_errors(QWEN3_5, config)
    assert any("padding_free=false" in e for e in errors)
    assert any("enable_chunked_prefill=true" in e for e in errors)
    assert any("worker.rollout.dtype=bf16" in e for e in errors)
    config = _config(padding_free=False)
    config.worker.rollout.enable_chunked_prefill, config.worker.rollout.dtype = True, "bf16"
    assert family_errors(QWEN3_5, config) == []


def test_start_up_names_the_gate_a_family_has_not_passed():
    ungated = dataclasses.replace(QWEN3_5, gates=tuple(g for g in GATES if g != "weight_sync"))
    config = _config(padding_free=False)
    config.worker.rollout.enable_chunked_prefill, config.worker.rollout.dtype = True, "bf16"
    (error,) = family_errors(ungated, config)
    assert "'weight_sync'" in error and "vlrl.tools.family_check --arch qwen3_5" in error


def test_processor_families_refuse_what_follows_the_qwen_layout():
    from vlrl.models.families.internvl import INTERNVL

    config = _config(ulysses_size=2)
    config.worker.rollout.multi_turn.enable = True
    errors = " ".join(family_errors(INTERNVL, config))
    assert "ulysses_size=2" in errors and "multi_turn" in errors
    config = _config()
    config.worker.rollout.name = "hf"
    assert any("worker.rollout.name=hf" in e for e in family_errors(INTERNVL, config))


def test_lora_and_freezing_take_internvl_projector_with_the_tower(tmp_path):
    """InternVL keeps its projector apart from the vision tower: LoRA must exclude it too (the lora
    gate measures the adapters; this says where the rule comes from)."""
    import re

    from transformers import AutoModelForImageTextToText

    from vlrl.config import LoraConfig
    from vlrl.models.loading import vision_modules
    from vlrl.models.lora import exclude_pattern
    from vlrl.models.tiny import build_tiny_model

    model = AutoModelForImageTextToText.from_pretrained(build_tiny_model(tmp_path / "m", "internvl"))
    assert [name for name, _ in vision_modules(model)] == [
        "model.vision_tower",
        "model.multi_modal_projector",
    ]
    pattern = re.compile(exclude_pattern(model, LoraConfig(rank=4)) or "")
    assert pattern.fullmatch("model.multi_modal_projector.linear_1")
    assert pattern.fullmatch("model.vision_tower.encoder.layer.0.mlp.fc1")
    assert not pattern.fullmatch("model.language_model.layers.0.mlp.up_proj")


@pytest.mark.parametrize("arch", ["internvl", "idefics3"])
def test_a_family_dummy_image_runs_through_its_model(arch, tmp_path):
    """A micro-batch without images on a rank whose peers have some runs the family's dummy image
    (`Family.dummy_image`) through the tower: its tokens must match the features the model makes
    of it, in the family's input layout (Idefics3 drops an all-zero tile as padding: its dummy is grey)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlrl.models.tiny import build_tiny_model
    from vlrl.workers.vision import dummy_image_anchor

    model = AutoModelForImageTextToText.from_pretrained(build_tiny_model(tmp_path / "m", arch)).eval()
    anchor = dummy_image_anchor(model.config, mrope=False, device="cpu")
    kwargs = {"input_ids": anchor.token_ids[None], "pixel_values": anchor.pixel_values,
              "image_grid_thw": anchor.image_grid_thw}  # fmt: skip
    with torch.no_grad():
        logits = model(**family_of(model.config).model_inputs(kwargs)).logits
    assert logits.shape[:2] == (1, len(anchor.token_ids)) and torch.isfinite(logits).all()


def test_gradient_gap_ignores_rounding_noise_but_not_a_real_gap():
    """A gradient zero in exact arithmetic (a key bias: ~1e-10 of noise) differs by 100% between
    packed and padded rows; that is no gap. A real one, above 1e-6 of the largest gradient, is."""
    import torch

    from vlrl.tools.family_check import _relative_gap

    padded = {"q": torch.tensor([1.0, -2.0]), "k_bias": torch.tensor([5e-10, -3e-10])}
    packed = {"q": torch.tensor([1.0, -2.0]), "k_bias": torch.tensor([-4e-10, 2e-10])}
    assert _relative_gap(packed, padded) < 1e-3
    packed["k_bias"] = torch.tensor([1e-3, 0.0])
    assert _relative_gap(packed, padded) > 1.0
    assert _relative_gap({"q": padded["q"]}, padded) == float("inf")


def test_a_vision_model_without_a_record_is_refused():
    with pytest.raises(ValueError, match="'gemma3' has no family record"):
        family_of({"model_type": "gemma3", "vision_config": {"model_type": "siglip_vision_model"}})
    assert family_of({"model_type": "mistral"}).name == "text"


def test_trainer_refuses_the_family_before_the_data_loads():
    """The driver's start-up check (before data, Ray and the ranks) names the key to change."""
    from transformers import AutoConfig

    from vlrl.config import ConfigError
    from vlrl.trainer.data_setup import _check_family

    config = _config()
    with pytest.raises(ConfigError, match="padding_free=false"):
        _check_family(AutoConfig.for_model("qwen3_5"), config)
    with pytest.raises(ConfigError, match="'gemma3' has no family record"):
        _check_family(AutoConfig.for_model("gemma3"), config)
    _check_family(AutoConfig.for_model("qwen2_5_vl"), config)  # a gated family with this config: fine


def test_glm4v_needs_its_config_to_build_q_k_v_biases_in_vllm():
    """transformers always gives GLM-4.1V's q/k/v a bias; vLLM builds it only with attention_bias
    set and otherwise drops the synced biases silently (the weight_sync gate measured 1e-3)."""
    from transformers import AutoConfig

    from vlrl.config import ConfigError
    from vlrl.trainer.data_setup import _check_family

    config = _config()
    hf_config = AutoConfig.for_model("glm4v", text_config={"attention_bias": True})
    _check_family(hf_config, config)
    hf_config.text_config.attention_bias = False
    with pytest.raises(ConfigError, match="attention_bias=True"):
        _check_family(hf_config, config)


@pytest.mark.parametrize("arch", ["glm4v", "internvl"])
def test_a_row_with_a_video_is_a_bad_row_for_a_family_without_videos(arch, tmp_path):
    from transformers import AutoConfig

    from vlrl.config import DataConfig
    from vlrl.data.prepare import RowPreparer, RowProblem
    from vlrl.models.processor import load_processor
    from vlrl.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "m", arch)
    tokenizer, processor = load_processor(str(path))
    preparer = RowPreparer(
        DataConfig(prompt_key="problem"), tokenizer, processor, AutoConfig.from_pretrained(path)
    )
    row = {"problem": "<video>What happens?", "answer": "1", "videos": [["a.png", "b.png"]]}
    with pytest.raises(RowProblem, match="videos are supported for the Qwen-VL families only") as err:
        preparer.text(row)
    assert err.value.reason == "video_family"
