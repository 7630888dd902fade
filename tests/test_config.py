"""Config loading, overrides and validation: every error names the key and says what to change."""

import logging
from pathlib import Path

import pytest

from vlrl.config import ConfigError
from vlrl.config.loader import describe, field_docs, load_config

REPO = Path(__file__).resolve().parents[1]


def test_defaults_yaml_then_overrides(tmp_path: Path, base: list[str]) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(
        "worker:\n  rollout:\n    n: 8\n    temperature: 0.7\ntrainer:\n  logger: [console]\n"
    )
    config = load_config([f"config={yaml_file}", *base, "worker.rollout.temperature=0.9"])
    assert config.worker.rollout.n == 4  # the override comes after the file
    assert config.worker.rollout.temperature == 0.9
    assert config.trainer.logger == ["console"]
    assert config.data.max_prompt_length == 512  # default kept
    # derived in one place
    assert config.worker.rollout.max_model_len == 1024
    assert config.worker.actor.model.tokenizer_path == config.worker.actor.model.model_path
    assert config.world_size == 2 and config.samples_per_step == 32
    assert config.samples_per_minibatch_per_rank == 8


def test_ulysses_groups_share_rows(base: list[str]) -> None:
    config = load_config([*base, "worker.actor.ulysses_size=2"])
    # 2 ranks in one sequence-parallel group: one data-parallel group takes the whole mini-batch
    assert config.dp_size == 1 and config.samples_per_minibatch_per_rank == 16


def test_override_value_types(base: list[str]) -> None:
    config = load_config(
        [
            *base,
            "algorithm.kl_coef=1e-2",  # YAML reads this as a string; coerced to float
            "worker.actor.optim.betas=[0.9,0.95]",
            'worker.reward.reward_function_kwargs={"format_weight": 0.5}',
            "worker.rollout.val_override_config={temperature: 0, n: 1}",
            "trainer.logger=console",
            "trainer.max_steps=null",
        ]
    )
    assert config.algorithm.kl_coef == pytest.approx(0.01)
    assert config.worker.actor.optim.betas == [0.9, 0.95]
    assert config.worker.reward.reward_function_kwargs == {"format_weight": 0.5}
    assert config.worker.rollout.val_override_config == {"temperature": 0, "n": 1}
    assert config.trainer.logger == ["console"]
    assert config.trainer.max_steps is None


def test_frozen_after_finalize(base: list[str]) -> None:
    config = load_config(base)
    with pytest.raises(AttributeError, match="frozen"):
        config.worker.rollout.n = 3


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "worker.rollout.temprature=0.5",
            r"unknown config key 'worker.rollout.temprature'; did you mean worker.rollout.temperature\?",
        ),
        ("data.rollout_bach_size=8", r"did you mean data.rollout_batch_size\?"),
        ("trainer.nope.x=1", r"unknown config key 'trainer.nope'"),
        ("worker.rollout.n=four", r"worker.rollout.n must be of type int, got 'four'"),
        ("worker.rollout.n=true", r"worker.rollout.n must be of type int"),
        ("trainer.logger=5", r"trainer.logger\[0\] must be of type str|trainer.logger must be a list"),
        (
            "worker.reward.reward_function_kwargs=[1]",
            r"worker.reward.reward_function_kwargs must be a mapping",
        ),
    ],
)
def test_bad_keys_and_types(base: list[str], override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config([*base, override])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.rollout_batch_size=6"], "data.rollout_batch_size=6 must be divisible by worker.actor.global_batch_size=4"),
        (["worker.actor.global_batch_size=1", "data.rollout_batch_size=1", "worker.rollout.n=3"],
         r"worker.actor.global_batch_size=1 x worker.rollout.n=3 must be divisible by the world size 2"),
        (["worker.actor.dynamic_batching=false", "worker.actor.micro_batch_size_per_device_for_update=3"],
         "each rank gets 8 samples per optimizer step .* divisible by worker.actor.micro_batch_size_per_device_for_update=3"),
        (["worker.rollout.n=1", "worker.actor.global_batch_size=2", "data.rollout_batch_size=4",
          "worker.actor.micro_batch_size_per_device_for_update=1"],
         "algorithm.adv_estimator=grpo compares samples of one prompt: set worker.rollout.n >= 2"),
        (["worker.rollout.tensor_parallel_size=3"], "worker.rollout.tensor_parallel_size=3 must divide the world size 2"),
        (["trainer.nnodes=2", "worker.rollout.tensor_parallel_size=4", "worker.actor.global_batch_size=8"],
         "worker.rollout.tensor_parallel_size=4 must divide trainer.n_gpus_per_node=2: a tensor-parallel group must sit on one node"),
        (["trainer.dist_timeout_minutes=0"], "trainer.dist_timeout_minutes=0.0 must be > 0"),
        (["worker.rollout.max_model_len=100"], r"worker.rollout.max_model_len=100 < data.max_prompt_length \+ data.max_response_length = 1024"),
        (["worker.rollout.max_num_batched_tokens=512"], "worker.rollout.max_num_batched_tokens=512 < prompt \\+ response length 1024"),
        (["algorithm.adv_estimator=grpoo"], r"algorithm.adv_estimator='grpoo' is unknown; choose one of \["),
        (["algorithm.kl_penalty=k9"], "algorithm.kl_penalty='k9' is unknown"),
        (["worker.actor.loss_avg_mode=mean"], "worker.actor.loss_avg_mode='mean' is unknown"),
        (["worker.actor.clip_ratio_dual=1.0"], "worker.actor.clip_ratio_dual=1.0 must be > 1"),
        (["worker.reward.reward_function=/no/such/file.py:fn"], "worker.reward.reward_function: file '/no/such/file.py' does not exist"),
        (["worker.reward.reward_function=null"], "worker.reward.reward_function is required"),
        (["trainer.logger=[console,neptune]"], r"trainer.logger has unknown entries \['neptune'\]"),
        (["worker.rollout.val_override_config={temprature: 0}"], r"val_override_config has unknown keys \['temprature'\]"),
        (["algorithm.online_filtering=true", "algorithm.filter_low=0.9", "algorithm.filter_high=0.1"],
         "algorithm.filter_low=0.9 must be < algorithm.filter_high=0.1"),
        (["data.format_prompt=/no/template.jinja"], "data.format_prompt: file '/no/template.jinja' does not exist"),
        (["worker.rollout.temperature=0"], r"worker.rollout.temperature=0.0 must be > 0: training needs sampled"),
        (["worker.actor.ulysses_size=3"], r"worker.actor.ulysses_size=3 must divide the world size 2"),
        (["worker.actor.ulysses_size=0"], r"worker.actor.ulysses_size=0 must be >= 1"),
        (["worker.actor.ulysses_size=2", "worker.ref.padding_free=false"],
         r"worker.actor.ulysses_size=2 splits packed rows: set worker.actor.padding_free=true"),
        (["trainer.n_gpus_per_node=4", "worker.actor.ulysses_size=2", "worker.actor.global_batch_size=1",
          "data.rollout_batch_size=1", "worker.rollout.n=3"],
         r"worker.rollout.n=3 must be divisible by the 2 data-parallel groups \(world size 4 / worker.actor.ulysses_size=2\)"),
        (["worker.reward.memory_limit_mb=10"], r"worker.reward.memory_limit_mb=10 must be >= 64 \(or null\)"),
        (["worker.reward.memory_limit_mb=500", "worker.reward.num_workers=0"],
         "worker.reward.memory_limit_mb caps worker processes: set worker.reward.num_workers >= 1"),
        (["trainer.val_only=true", "data.val_files="], "trainer.val_only=true validates and exits, and needs data.val_files"),
        # numbers out of range, each named by key before anything starts
        (["worker.actor.optim.lr=-1e-5"], r"worker.actor.optim.lr=-1e-05 must be a finite number >= 0"),
        (["worker.actor.optim.lr=.nan"], r"worker.actor.optim.lr=nan must be a finite number >= 0"),
        (["algorithm.kl_coef=-0.1"], r"algorithm.kl_coef=-0.1 must be a finite number >= 0"),
        (["algorithm.low_var_kl_clamp=0"], r"algorithm.low_var_kl_clamp=0.0 must be a finite number > 0, or null"),
        (["algorithm.kl_loss_ratio_weighted=true", "algorithm.use_kl_loss=false"], r"algorithm.kl_loss_ratio_weighted=true weights the KL loss, which is off: set algorithm.use_kl_loss=true"),
        (["worker.rollout.top_p=0"], r"worker.rollout.top_p=0.0 must be in \(0, 1\]"),
        (["worker.rollout.top_k=0"], r"worker.rollout.top_k=0 must be -1 \(off\) or >= 1"),
        (["worker.rollout.n=100000"], r"worker.rollout.n=100000 must be in \[1, 16384\] \(vLLM's limit"),
        (["worker.actor.clip_ratio_low=1.5"], r"worker.actor.clip_ratio_low=1.5 must be in \[0, 1\)"),
        (["trainer.save_freq=0"], r"trainer.save_freq=0 must be -1 \(only at the end\) or N >= 1"),
        (["trainer.save_limit=0"], r"trainer.save_limit=0 must be -1 \(keep all\) or N >= 1"),
        (["trainer.val_freq=-2"], r"trainer.val_freq=-2 must be -1"),
        (["trainer.hang_timeout=-1"], r"trainer.hang_timeout=-1.0 must be >= 0"),
        (["worker.reward.max_failure_rate=1.5"], r"worker.reward.max_failure_rate=1.5 must be in \[0, 1\]"),
    ],
)  # fmt: skip
def test_cross_field_rules(base: list[str], overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config([*base, *overrides])


def test_all_errors_reported_at_once(base: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([*base, "data.rollout_batch_size=6", "algorithm.kl_penalty=k9"])
    assert "rollout_batch_size=6" in str(info.value) and "kl_penalty='k9'" in str(info.value)


def test_bad_argument_and_missing_file() -> None:
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(["worker.rollout.n"])
    with pytest.raises(ConfigError, match="config file 'missing.yaml' does not exist"):
        load_config(["config=missing.yaml"])


def test_every_field_has_a_docstring() -> None:
    from dataclasses import fields, is_dataclass

    from vlrl import config as cfg

    for cls in (cfg.DataConfig, cfg.AlgorithmConfig, cfg.ModelConfig, cfg.OptimConfig, cfg.FSDPConfig,
                cfg.OffloadConfig, cfg.ActorConfig, cfg.RefConfig, cfg.RolloutConfig, cfg.RewardConfig,
                cfg.TrainerConfig):  # fmt: skip
        docs = field_docs(cls)
        for f in fields(cls):
            if not is_dataclass(f.type) and f.name not in ("model", "optim", "fsdp", "offload"):
                assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"


def test_describe_lists_every_leaf(base: list[str]) -> None:
    lines = describe(load_config(base))
    assert any(line.startswith("worker.rollout.n = 4") and "GRPO group size" in line for line in lines)


def test_example_configs_load() -> None:
    """Every YAML in examples/ parses into the config tree (paths are not checked here)."""
    for path in sorted((REPO / "examples").glob("*.yaml")):
        load_config([f"config={path}"], finalize=False)


def test_config_reference_is_current() -> None:
    from vlrl.tools.config_docs import render

    assert (REPO / "docs" / "config.md").read_text() == render(), (
        "run: python -m vlrl.tools.config_docs > docs/config.md"
    )


def test_config_reference_keeps_each_key_on_one_table_row() -> None:
    """A multi-line docstring once broke its table row in two (the rest showed as plain text)."""
    from vlrl.tools.config_docs import render

    rows = [line for line in render().splitlines() if line.startswith("| `")]
    assert len(rows) > 100
    assert all(row.endswith(" |") and row.count(" | ") >= 2 for row in rows)
    assert not [line for line in render().splitlines() if line.startswith("    ")]


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """An online hub that is never in the cache and whose port refuses connections at once."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr("vlrl.config.paths._in_cache", lambda repo, repo_type: False)
    monkeypatch.setattr("vlrl.config.paths.hub_endpoint", lambda: "http://127.0.0.1:9")


@pytest.mark.parametrize(
    "value, message",
    [
        ("outputs/quickstart_model", r"local folder 'outputs/quickstart_model' does not exist \(closest existing folder: .*outputs, holding: other_model\)"),
        ("/no/such/model", r"local folder '/no/such/model' does not exist"),
        ("./tiny", r"local folder './tiny' does not exist \(closest existing folder: .*holding: .*outputs"),
        ("a/b/c", r"local folder 'a/b/c' does not exist"),
        ("~/tiny", r"local folder '~/tiny' does not exist"),
        ("nobody-xyz/no-model", r"'nobody-xyz/no-model' is not a local folder and was read as a hub model id, but it is not in the local cache and the hub is unreachable: 127.0.0.1:9 cannot be reached"),
    ],
)  # fmt: skip
def test_model_path_fails_in_seconds(base, tmp_path, monkeypatch, no_hub, value, message) -> None:
    import time

    (tmp_path / "outputs" / "other_model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(ConfigError, match="worker.actor.model.model_path: " + message):
        load_config([*base, f"worker.actor.model.model_path={value}"])
    assert time.monotonic() - start < 5


def test_hub_ids_offline_and_cached(base, monkeypatch, no_hub) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ConfigError, match=r"hub model id, but it is not in the local cache and HF_HUB_OFFLINE .* \(offline\)"
    ):
        load_config([*base, "worker.actor.model.model_path=Qwen/Qwen2.5-VL-3B-Instruct"])
    with pytest.raises(
        ConfigError,
        match=r"data.val_files: 'org/shapes@test' is not a local file and was read as a hub dataset, but .*offline",
    ):
        load_config([*base, "data.val_files=org/shapes@test"])
    monkeypatch.setattr("vlrl.config.paths._in_cache", lambda repo, repo_type: True)
    load_config(
        [*base, "worker.actor.model.model_path=Qwen/Qwen2.5-VL-3B-Instruct", "data.val_files=org/shapes@test"]
    )


def test_data_path_that_looks_local_is_not_sent_to_the_hub(base, tmp_path, monkeypatch, no_hub) -> None:
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=r"data.train_files: data/shapes@train: no such file or folder \(closest"
    ):
        load_config([*base, "data.train_files=data/shapes@train"])
    with pytest.raises(
        ConfigError,
        match=r"data.train_files: 'org/shapes' is not a local file and was read as a hub dataset, but .*hub is unreachable",
    ):
        load_config([*base, "data.train_files=org/shapes"])


def test_hub_behind_an_unreachable_proxy(base, monkeypatch, no_hub) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    with pytest.raises(
        ConfigError, match=r"hub model id, but it is not in the local cache and the hub did not answer"
    ):
        load_config([*base, "worker.actor.model.model_path=nobody-xyz/no-model"])


def test_tilde_is_not_expanded_in_model_paths(base, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "tiny").mkdir()
    with pytest.raises(ConfigError, match=r"'~/tiny': '~' is not expanded in model paths; write '.*/tiny'"):
        load_config([*base, "worker.actor.model.model_path=~/tiny"])


def test_disable_kl_turns_the_kl_loss_off(base: list[str]) -> None:
    """EasyR1's config.yaml sets use_kl_loss and its DAPO/GSPO/SAPO recipes add disable_kl: no
    reference is loaded, so the KL loss must be off too (it crashed the first update before)."""
    config = load_config([*base, "algorithm.use_kl_loss=true", "algorithm.disable_kl=true"])
    assert not config.algorithm.use_kl_loss and not config.plan.reference
    assert load_config([*base, "algorithm.use_kl_loss=true"]).algorithm.use_kl_loss


def test_paths_the_ranks_open_are_absolute(base: list[str], tmp_path: Path, monkeypatch) -> None:
    """A Ray worker runs in its raylet's folder, not the driver's: relative local paths that the
    ranks open (model, checkpoints, tools) are made absolute at start-up; hub ids stay as given."""
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "tool.py").write_text("def main(): pass\n")
    (tmp_path / "fmt.jinja").write_text("{{ content }}")
    monkeypatch.chdir(tmp_path)
    config = load_config([*base, "worker.actor.model.model_path=models/tiny", "trainer.save_checkpoint_path=runs/a",
                          "worker.rollout.multi_turn.tools=[tool.py:main]", "data.format_prompt=fmt.jinja"])  # fmt: skip
    assert config.worker.actor.model.model_path == str(tmp_path / "models" / "tiny")
    assert config.worker.actor.model.tokenizer_path == str(tmp_path / "models" / "tiny")
    assert config.trainer.save_checkpoint_path == str(tmp_path / "runs" / "a")
    assert config.worker.rollout.multi_turn.tools == [f"{tmp_path / 'tool.py'}:main"]
    assert config.data.format_prompt == str(tmp_path / "fmt.jinja")  # multi-turn tool turns render it
    assert load_config(
        [*base, "trainer.project_name=p", "trainer.experiment_name=e"]
    ).trainer.save_checkpoint_path == str(tmp_path / "checkpoints" / "p" / "e")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], "actor"),  # synchronous: EasyR1's ratio
        (["worker.rollout.async_ranks=1", "worker.rollout.name=vllm"], "rollout"),
        (["worker.rollout.async_ranks=1", "worker.rollout.name=vllm", "algorithm.tis_cap=2"], "actor"),
        (["worker.rollout.async_ranks=1", "worker.rollout.name=vllm", "worker.rollout.calculate_log_probs=false"],
         "actor"),
        (["algorithm.old_policy=rollout"], "rollout"),
    ],
)  # fmt: skip
def test_old_policy_auto_is_the_sampling_policy_in_asynchronous_mode(
    base: list[str], overrides: list[str], expected: str
) -> None:
    assert load_config([*base, *overrides]).algorithm.old_policy == expected


ASYNC = ["worker.rollout.async_ranks=1", "worker.rollout.name=vllm"]


@pytest.mark.parametrize(
    "overrides, dual, warmup",
    [
        ([], 3.0, None),  # EasyR1's
        ([*ASYNC, "worker.rollout.max_staleness=1"], 3.0, None),  # one step off: unchanged
        ([*ASYNC, "worker.rollout.max_staleness=2"], 1.3, 5),  # 1 + clip_ratio_high (0.3)
        ([*ASYNC, "worker.rollout.max_staleness=4", "worker.actor.clip_ratio_high=0.28"], 1.28, 5),
        ([*ASYNC, "worker.rollout.max_staleness=2", "worker.actor.clip_ratio_dual=3.0",
          "worker.actor.optim.lr_warmup_steps=0"], 3.0, 0),  # explicit values win
        ([*ASYNC, "worker.rollout.max_staleness=2", "worker.actor.optim.lr_warmup_ratio=0.1"], 1.3, None),
        ([*ASYNC, "worker.rollout.max_staleness=2", "algorithm.tis_cap=2"], 3.0, None),  # ratio from the actor
    ],
)  # fmt: skip
def test_two_or_more_steps_off_default_to_a_trust_region_around_the_sampling_policy(
    base: list[str], overrides: list[str], dual: float, warmup: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="vlrl.config"):
        actor = load_config([*base, *overrides]).worker.actor
    assert actor.clip_ratio_dual == pytest.approx(dual) and actor.optim.lr_warmup_steps == warmup
    assert ("a trust region around the sampling policy" in caplog.text) == (dual < 3.0)


def test_old_policy_rollout_needs_the_engines_log_probs_and_no_tis(base: list[str]) -> None:
    for extra in ("algorithm.tis_cap=2", "worker.rollout.calculate_log_probs=false"):
        with pytest.raises(ConfigError, match="algorithm.old_policy=rollout measures the ratio"):
            load_config([*base, "algorithm.old_policy=rollout", extra])
    with pytest.raises(ConfigError, match="algorithm.old_policy='behaviour' is unknown"):
        load_config([*base, "algorithm.old_policy=behaviour"])


def test_partial_rollouts_need_generations_in_flight_and_the_sampling_ratio(base: list[str]) -> None:
    two_ranks = [
        *base,
        "trainer.n_gpus_per_node=2",
        "worker.rollout.name=vllm",
        "worker.rollout.partial_rollouts=true",
    ]
    for extra in (
        [],
        ["worker.rollout.async_ranks=1"],
        ["worker.rollout.async_ranks=1", "worker.rollout.max_staleness=1"],
    ):
        with pytest.raises(
            ConfigError, match="partial_rollouts needs asynchronous mode with generations in flight"
        ):
            load_config([*two_ranks, *extra])
    in_flight = [*two_ranks, "worker.rollout.async_ranks=1", "worker.rollout.max_staleness=2"]
    assert load_config(in_flight).worker.rollout.partial_rollouts
    with pytest.raises(ConfigError, match="would measure the ratio from a policy that sampled none"):
        load_config([*in_flight, "algorithm.old_policy=actor"])
    load_config([*in_flight, "algorithm.old_policy=actor", "algorithm.off_policy_correction=seq_mask"])
