"""Adapters on the tiny models (no FSDP): which modules get them, and the merged stream the engines get."""

from __future__ import annotations

import copy

import pytest
import torch
from rollout_helpers import load_hf_model

from vlrl.config import LoraConfig
from vlrl.models.lora import apply_lora, merged_named_tensors
from vlrl.rollout.weight_sync import full_named_tensors, runtime_name


def _lora(path: str, **kwargs) -> torch.nn.Module:
    model = apply_lora(load_hf_model(path), LoraConfig(rank=4, alpha=8, **kwargs))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def _adapted(model: torch.nn.Module) -> set[str]:
    return {n.split(".lora_A.")[0] for n, _ in model.named_parameters() if ".lora_A." in n}


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen2"])
def test_merged_stream_equals_peft_merge(tiny_model, arch):
    model = _lora(tiny_model(arch))
    ours = {runtime_name(k): v for k, v in full_named_tensors(model)}
    theirs = copy.deepcopy(model).merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, atol=1e-6, rtol=0)
    changed = [
        k for k in theirs if not torch.equal(theirs[k], load_hf_model(tiny_model(arch)).state_dict()[k])
    ]
    assert changed  # the adapters are not zero: the merge did something


def test_vision_tower_never_gets_adapters_even_when_named(tiny_model):
    """The vision MLP has gate/up/down_proj too; only the text decoder's get adapters."""
    model = _lora(tiny_model("qwen2_5_vl"), target_modules="down_proj,q_proj")
    adapted = _adapted(model)
    assert adapted and not any("visual" in n for n in adapted)
    assert {n.rsplit(".", 1)[1] for n in adapted} == {"down_proj", "q_proj"}


def test_exclude_modules_regex(tiny_model):
    model = _lora(tiny_model("qwen2_5_vl"), exclude_modules=r".*layers\.0\..*")
    adapted = _adapted(model)
    assert adapted and not any(".layers.0." in n for n in adapted)
    assert any(".layers.1." in n for n in adapted)


def test_easyr1_visual_exclusion_on_a_text_model_is_quiet(tiny_model):
    """EasyR1's config excludes `.*visual.*`; a text model has no such module: every linear layer
    gets an adapter and peft has nothing to warn about (it warned on every rank)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = _lora(tiny_model("qwen2"), exclude_modules=".*visual.*")
    assert any(".layers.0.self_attn.q_proj" in n for n in _adapted(model))


def test_no_matching_module_fails_clearly(tiny_model):
    with pytest.raises(ValueError, match="no module of .* got an adapter"):
        _lora(tiny_model("qwen2"), target_modules="no_such_proj")


def test_unpaired_adapter_tensors_fail():
    named = [("x.base_layer.weight", torch.ones(2, 2)), ("x.lora_A.default.weight", torch.ones(1, 2))]
    with pytest.raises(ValueError, match="unpaired"):
        list(merged_named_tensors(named, 1.0))
