"""The run's configuration: one package for the schema and everything done to it before a run.

- `schema`: the dataclasses (every key, its default and docstring), derived values (`finalize`);
- `loader`: YAML file + `key.sub=value` overrides -> `PPOConfig`, every unknown key named;
- `checks`: values, combinations and files checked at start-up, before Ray or a model starts;
- `paths`: local paths made absolute, model folders and hub ids told apart;
- `easyr1`: how EasyR1's tree maps here (aliases, deliberate defaults, keys without effect or not
  implemented).

`from vlrl.config import PPOConfig, ConfigError, ...` reads the schema's names from here.
"""

from vlrl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    ConfigError,
    DataConfig,
    FSDPConfig,
    LoraConfig,
    ModelConfig,
    MultiTurnConfig,
    OffloadConfig,
    OptimConfig,
    PPOConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    WorkerConfig,
    _Section,
    resolve_device,
)

__all__ = [
    "ActorConfig", "AlgorithmConfig", "ConfigError", "DataConfig", "FSDPConfig", "LoraConfig", "ModelConfig",
    "MultiTurnConfig", "OffloadConfig", "OptimConfig", "PPOConfig", "RefConfig", "RewardConfig", "RolloutConfig",
    "TrainerConfig", "WorkerConfig", "_Section", "resolve_device",
]  # fmt: skip
