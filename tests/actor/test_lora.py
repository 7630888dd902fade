"""LoRA actor on two gloo ranks (FSDP2): adapters only train, reference = adapters off, merged weights,
exact resume, HF export and the model merger (see lora_job.py for what each rank runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from actor_helpers import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def job(actor_model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import lora_job

    out = tmp_path_factory.mktemp("lora")
    model = actor_model("qwen2_5_vl")
    launch(lora_job.run, 2, model, str(out))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {
        "ranks": ranks,
        "out": out,
        "model": model,
        "batch": torch.load(out / "batch.pt", weights_only=False),
    }


def test_only_text_decoder_adapters_are_trainable(job):
    r = job["ranks"][0]
    assert r["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in r["trainable"])
    assert not any("visual" in n for n in r["trainable"])  # the vision tower gets no adapters
    assert any("visual" in n for n in r["all_names"])  # (it is there, frozen)
    assert any(n.endswith("mlp.down_proj.lora_A.default.weight") for n in r["trainable"])  # all-linear
    assert not any("lm_head.lora" in n for n in r["trainable"])  # ... but not the output layer
    assert r["optimizer_params_are_trainable"]


def test_initial_adapters_leave_the_policy_unchanged(job):
    assert all(r["init_err"] < 1e-4 for r in job["ranks"])


def test_training_moves_only_the_adapters(job):
    for r in job["ranks"]:
        assert r["base_err"] == 0.0  # every base weight, vision tower included, bit-identical
        assert r["lora_B_moved"] > 0
        assert r["optimizer_state_names"] == sorted(r["trainable"])  # AdamW states for adapters only
        assert r["policy_moved"] > 1e-3
    losses = job["ranks"][0]["losses"]
    assert losses[-1] < losses[0], losses


def test_reference_is_the_base_model_with_adapters_off(job):
    for r in job["ranks"]:
        assert r["ref_err"] < 1e-4  # equals the untouched model on disk, after training
        assert r["after_ref_err"] == 0.0  # and the adapters are back on afterwards


def test_engines_get_merged_weights_with_base_names(job):
    r = job["ranks"][0]
    assert r["merged_keys"] == ([], [])
    assert r["merged_err"] < 1e-4


def test_checkpoint_holds_adapters_and_resumes_exactly(job):
    for r in job["ranks"]:
        assert r["ckpt_moved"] > 0
        assert r["ckpt_weights_err"] == 0.0
        assert r["ckpt_resume_err"] == 0.0
    keys = job["ranks"][0]["ckpt_model_keys"]
    trainable = job["ranks"][0]["trainable"]
    assert keys == sorted(f"model.{n}" for n in trainable)  # the frozen base is not written


def test_gradient_checkpointing_reaches_the_adapters(job):
    r = job["ranks"][0]
    assert r["ckpting_layers/False"] == 0 and r["ckpting_layers/True"] > 0
    assert r["ckpting_grad_keys"] and all("lora_" in n for n in r["ckpting_grad_names"])
    assert r["ckpting_grad_norm"] > 0
    assert r["ckpting_grad_err"] < 1e-6


def _log_probs(model, job) -> torch.Tensor:
    from actor_single_job import plain_log_probs

    return plain_log_probs(job["model"], job["batch"], model)


def _max_err(a: torch.Tensor, b: torch.Tensor, job) -> float:
    return float((a - b)[job["batch"].response_mask.bool()].abs().max())


def test_save_hf_writes_merged_weights(job):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(job["out"] / "hf")
    assert _max_err(_log_probs(model, job), job["ranks"][0]["actor_logp"], job) < 1e-4


def test_model_merger_exports_merged_folder_and_adapter(job):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from vlrl.tools.model_merger import main, merge

    actor_dir = job["out"] / "merger" / "actor"
    expected = job["ranks"][0]["actor_logp"]
    merged = Path(merge(str(actor_dir)))
    with safe_open(str(merged / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())  # noqa: SIM118 (a safetensors handle, not a dict)
    assert names and not any("lora" in k or "base_layer" in k for k in names)
    model = AutoModelForImageTextToText.from_pretrained(merged)
    assert _max_err(_log_probs(model, job), expected, job) < 1e-4

    main(["--local_dir", str(actor_dir), "--adapter_only"])
    adapter = actor_dir / "lora_adapter"
    assert (adapter / "adapter_config.json").is_file()
    base = AutoModelForImageTextToText.from_pretrained(job["model"])
    wrapped = PeftModel.from_pretrained(base, adapter)
    assert _max_err(_log_probs(wrapped, job), expected, job) < 1e-4


def test_merger_refuses_adapter_only_for_a_full_checkpoint(tmp_path):
    from vlrl.tools.model_merger import merge

    (tmp_path / "hf_config").mkdir()
    (tmp_path / "dcp").mkdir()
    with pytest.raises(ValueError, match="not a LoRA checkpoint"):
        merge(str(tmp_path), adapter_only=True)
