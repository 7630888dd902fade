"""`worker.actor.model.gradient_checkpointing_layers`: every K-th layer of the decoder and of the
vision tower recomputes its activations, with FSDP2 (tests/actor/checkpoint_policy_job.py), and the
gradients do not depend on which layers do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from actor_helpers import launch

from vlrl.config.checks import gradient_checkpointing_interval

pytestmark = pytest.mark.timeout(600)

LAYERS = 5


@pytest.fixture(scope="module")
def job(actor_model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import checkpoint_policy_job

    out = tmp_path_factory.mktemp("checkpoint_policy")
    launch(checkpoint_policy_job.run, 1, actor_model("qwen2_5_vl"), str(out))
    return torch.load(Path(out) / "results.pt", weights_only=False)


def _expected(every: int | None) -> list[bool]:
    return [every is not None and i % every == 0 for i in range(LAYERS)]


@pytest.mark.parametrize(
    ("policy", "every"), [("None", None), ("every_k:2", 2), ("every_k:3", 3), ("all", 1)]
)
def test_every_kth_layer_is_recomputed(job, policy, every):
    result = job[policy]
    # FSDP2 units (fully_shard swaps in an FSDP subclass): the flags survive the sharding
    assert result["stacks"] == ["FSDPQwen2_5_VLVisionBlock", "FSDPQwen2_5_VLDecoderLayer"]
    expected = _expected(every)
    assert result["flags"] == [expected, expected]
    # one forward each; the checkpointed layers run once more in the backward
    assert result["forward"] == [[1] * LAYERS] * 2
    assert result["calls"] == [[1 + int(e) for e in expected]] * 2
    recomputed = sum(c == 2 for stack in result["calls"] for c in stack)
    assert recomputed == 2 * len(range(0, LAYERS, every)) if every else recomputed == 0


@pytest.mark.parametrize("policy", ["every_k:2", "every_k:3", "all"])
def test_gradients_do_not_depend_on_the_policy(job, policy):
    plain, checkpointed = job["None"]["grads"], job[policy]["grads"]
    assert plain.keys() == checkpointed.keys()
    assert any(n.startswith("model.visual.blocks.") for n in plain)  # the tower is trained too
    assert max(float(g.abs().max()) for g in plain.values()) > 0.1
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=0, msg=name)


def test_the_config_key_reaches_the_actor(job):
    # the tiny model: 2 vision blocks, 2 decoder layers
    assert job["actor_flags"] == [[True, False], [True, False]]


@pytest.mark.parametrize(("value", "every"), [("all", 1), ("every_k:1", 1), ("every_k:4", 4)])
def test_interval(value, every):
    assert gradient_checkpointing_interval(value) == every


@pytest.mark.parametrize("value", ["every_k:0", "every_k:-2", "every_k:two", "none", "", "every_k:"])
def test_bad_values_name_the_key(value, base):
    from vlrl.config import ConfigError
    from vlrl.config.loader import load_config

    with pytest.raises(ConfigError, match="worker.actor.model.gradient_checkpointing_layers"):
        load_config([*base, f"worker.actor.model.gradient_checkpointing_layers={value}"])
