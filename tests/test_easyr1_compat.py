"""EasyR1 keys carry over: one error for every bad key, aliases, not-yet-supported values fail at
start-up, deliberate default differences are logged, print_config accepts YAML booleans."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vlrl.config import ConfigError, PPOConfig
from vlrl.config.easyr1 import DELIBERATE_DEFAULTS, startup_notes
from vlrl.config.loader import given_keys, load_config


def test_every_bad_key_of_file_and_overrides_in_one_error(tmp_path: Path, base: list[str]) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(
        "data:\n  promt_key: q\nworker:\n  actor:\n    fsdp:\n      enable_full_shrd: true\n"
        "  rollout:\n    top_k: many\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config([f"config={yaml_file}", *base, "worker.rollout.temprature=0.5", "trainer.nope=1"])
    text = str(info.value)
    assert text.startswith("5 problem(s)"), text
    assert "worker.rollout.top_k must be of type int, got 'many'" in text
    for expected in (
        "'data.promt_key'; did you mean data.prompt_key?",
        "'worker.actor.fsdp.enable_full_shrd'; did you mean worker.actor.fsdp.enable_full_shard?",
        "'worker.rollout.temprature'; did you mean worker.rollout.temperature?",
        "unknown config key 'trainer.nope'",
    ):
        assert expected in text, text


def test_wrong_type_in_file_is_reported_with_unknown_keys(tmp_path: Path, base: list[str]) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("data:\n  max_prompt_length: long\n  bogus: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config([f"config={yaml_file}", *base])
    assert "data.max_prompt_length must be of type int" in str(info.value)
    assert "unknown config key 'data.bogus'" in str(info.value)


@pytest.mark.parametrize(
    "value, policy", [("default", "ppo"), ("cispo", "cispo"), ("gspo_token", "gspo_token")]
)
def test_loss_type_is_an_alias_of_policy_loss(base: list[str], value: str, policy: str) -> None:
    assert load_config([*base, f"worker.actor.loss_type={value}"]).worker.actor.policy_loss == policy


def test_alias_and_target_disagreeing_is_an_error(base: list[str]) -> None:
    with pytest.raises(
        ConfigError, match="worker.actor.loss_type='gspo' and worker.actor.policy_loss='cispo' disagree"
    ):
        load_config([*base, "worker.actor.loss_type=gspo", "worker.actor.policy_loss=cispo"])
    config = load_config([*base, "worker.actor.loss_type=default", "worker.actor.policy_loss=ppo"])
    assert config.worker.actor.policy_loss == "ppo"


def test_reward_num_cpus_sets_reward_processes(base: list[str]) -> None:
    assert load_config([*base, "worker.reward.num_cpus=3"]).worker.reward.num_workers == 3


def test_easyr1_only_sections_load(base: list[str]) -> None:
    config = load_config(
        [
            *base,
            "worker.ref.fsdp.enable_cpu_offload=true",
            "worker.ref.fsdp.enable_rank0_init=true",
            "worker.ref.offload.offload_params=false",
            "worker.actor.fsdp.use_orig_params=true",
            "worker.actor.fsdp.torch_dtype=bf16",
            "worker.actor.ulysses_size=1",
            "worker.actor.tau_positive=0.9",
            "worker.rollout.disable_tqdm=true",
            "trainer.ray_timeline=/tmp/timeline.json",
            "trainer.logger=['console','swanlab','mlflow']",
            "data.video_fps=1.0",
            "worker.hybrid_engine=true",
        ]
    )
    assert config.worker.ref.fsdp.enable_cpu_offload and not config.worker.actor.fsdp.enable_cpu_offload
    assert config.worker.actor.tau_positive == 0.9 and config.worker.actor.tau_negative == 1.05
    assert config.trainer.logger == ["console", "swanlab", "mlflow"]


def test_critic_keys_stop_the_run_naming_each_key(base: list[str]) -> None:
    """No critic is trained here: its keys are an error that lists them, never loaded and ignored."""
    with pytest.raises(ConfigError) as info:
        load_config([*base, "worker.critic.cliprange_value=0.3", "worker.critic.model.model_path=/m",
                     "trainer.critic_warmup=0", "algorithm.lam=0.95"])  # fmt: skip
    message = str(info.value)
    assert "4 problem(s)" not in message and "3 problem(s)" in message
    assert "worker.critic.cliprange_value, worker.critic.model.model_path: vlrl trains no critic" in message
    assert "trainer.critic_warmup: steps that train only the critic" in message
    assert "algorithm.lam: GAE's lambda" in message


def test_gae_is_not_an_estimator(base: list[str]) -> None:
    with pytest.raises(
        ConfigError, match=r"algorithm.adv_estimator='gae' is unknown; choose one of \['dr_grpo'"
    ):
        load_config([*base, "algorithm.adv_estimator=gae"])


def test_reference_follows_the_actor_unless_set(base: list[str]) -> None:
    config = load_config([*base, "worker.actor.micro_batch_size_per_device_for_experience=2"])
    assert config.worker.ref.micro_batch_size_per_device_for_experience == 2
    assert config.worker.ref.padding_free is True
    config = load_config([*base, "worker.ref.micro_batch_size_per_device_for_experience=8"])
    assert config.worker.ref.micro_batch_size_per_device_for_experience == 8


@pytest.mark.parametrize(
    "override, message",
    [
        ("worker.hybrid_engine=false", "worker.hybrid_engine=false: the actor and reference always share their ranks"),
        ("worker.actor.strategy=megatron", "worker.actor.strategy='megatron': only fsdp"),
        ("worker.ref.strategy=megatron", "worker.ref.strategy='megatron': only fsdp"),
        ("worker.actor.fsdp.fsdp_size=0", "worker.actor.fsdp.fsdp_size=0 must be -1 or >= 1"),
        ("worker.ref.fsdp.mp_buffer_dtype=bf16", "worker.ref.fsdp.mp_buffer_dtype='bf16': only fp32"),
        ("worker.actor.fsdp.torch_dtype=half", "worker.actor.fsdp.torch_dtype='half' is unknown"),
        ("data.filter_overlong_prompts_workers=0", "data.filter_overlong_prompts_workers=0 must be >= 1"),
    ],
)  # fmt: skip
def test_values_without_a_feature_fail_at_start_up(base: list[str], override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config([*base, override])


def test_missing_logger_package_fails_at_start_up(base: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "swanlab" else real(name))
    with pytest.raises(ConfigError, match="'swanlab' package is not installed: pip install swanlab"):
        load_config([*base, "trainer.logger=[console,swanlab]"])


def test_startup_notes_list_deliberate_defaults_left_unset(base: list[str]) -> None:
    argv = [*base, "trainer.project_name=p", "worker.actor.fsdp.use_orig_params=true"]
    notes = startup_notes(load_config(argv), given_keys(argv))
    text = "\n".join(notes)
    assert "trainer.project_name" not in text  # set: EasyR1's default does not matter
    assert "trainer.logger = ['console', 'file'] (EasyR1's default: ['console', 'wandb'])" in text
    assert "worker.actor.fsdp.use_orig_params is set but has no effect" in text
    assert len(notes) == len(DELIBERATE_DEFAULTS) - 1 + 1


def test_deliberate_table_only_names_real_differences() -> None:
    """Each entry's EasyR1 value differs from vlrl's default (else it is not a difference)."""
    config = PPOConfig()
    for key, (easyr1, _) in DELIBERATE_DEFAULTS.items():
        node = config
        for part in key.split("."):
            node = getattr(node, part)
        assert node != easyr1, key


@pytest.mark.parametrize(
    "value, expected", [("true", True), ("True", True), ("1", True), ("false", False), ("0", False)]
)
def test_print_config_values(value: str, expected: bool) -> None:
    from vlrl.trainer.main import print_config_requested

    assert print_config_requested(["a=1", f"print_config={value}"]) is expected


def test_print_config_rejects_non_booleans() -> None:
    from vlrl.trainer.main import print_config_requested

    with pytest.raises(ConfigError, match="print_config='maybe' must be true or false"):
        print_config_requested(["print_config=maybe"])


@pytest.mark.parametrize("value", ["True", "1"])
def test_print_config_prints_and_exits(
    base: list[str], value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from vlrl.trainer.main import run

    assert run([*base, f"print_config={value}"]) == 0
    out = capsys.readouterr()
    assert "worker.rollout.n = 4" in out.out
    assert "[vlrl] config: trainer.logger" in out.err


def test_sapo_temperatures_come_from_the_config() -> None:
    from vlrl.algorithms.losses import sapo

    ratio = torch.tensor([[1.3, 0.8]])
    adv = torch.tensor([[1.0, -1.0]])
    old = torch.zeros(1, 2)
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3, "clip_ratio_dual": 3.0}
    loss, _ = sapo(old, ratio.log(), adv, torch.ones(1, 2), tau_positive=0.5, tau_negative=2.0, **kw)
    tau = torch.tensor([[0.5, 2.0]])
    expected = -adv * torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    torch.testing.assert_close(loss, expected)


def test_lr_warmup_steps_count_trainer_steps() -> None:
    from vlrl.config import OptimConfig
    from vlrl.workers.optim import lr_factor

    cfg = OptimConfig(lr_warmup_steps=2)
    # 4 optimizer steps per trainer step: warm-up lasts 8 optimizer steps (EasyR1: 2 trainer steps)
    factors = [lr_factor(step, cfg, 100, per_trainer_step=4) for step in range(10)]
    assert factors[7] == 1.0 and factors[8] == 1.0 and factors[6] < 1.0


def test_dynamic_batching_budget_scales_with_micro_batch_size() -> None:
    from vlrl.workers.sharded_model import ShardedModel

    spec = SimpleNamespace(max_token_len_per_device=None)
    fake = SimpleNamespace(spec=spec, all_reduce=lambda values, op=None: values)
    batch = SimpleNamespace(input_ids=torch.zeros(6, 300, dtype=torch.long))
    assert ShardedModel.token_budget(fake, batch, 4) == 1200  # EasyR1: micro-batch size x width
    spec.max_token_len_per_device = 500
    assert ShardedModel.token_budget(fake, batch, 4) == 500


@pytest.mark.slow
def test_torch_compile_scores_like_eager() -> None:
    """`worker.actor.use_torch_compile`: the compiled log-prob/entropy function gives the eager
    values and gradients (compiling takes a minute or two on CPU)."""
    from vlrl.models.packing import score_tokens
    from vlrl.models.sampling import SamplingDistribution

    torch.manual_seed(0)
    logits = torch.randn(37, 50, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    sampling = SamplingDistribution(0.7, (3, 5))
    eager = score_tokens(logits, targets, sampling, True, True, compiled=False)
    compiled = score_tokens(logits, targets, sampling, True, True, compiled=True)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    (grad_eager,) = torch.autograd.grad(eager[0].sum() + eager[1].sum(), logits)
    (grad_compiled,) = torch.autograd.grad(compiled[0].sum() + compiled[1].sum(), logits)
    torch.testing.assert_close(grad_eager, grad_compiled, atol=1e-5, rtol=1e-5)
