"""Per-rank compute: the FSDP2 actor and reference policy, and their building blocks.

- `sharded_model.ShardedModel`: an FSDP2-sharded model that computes response log-probs (built
  from a `ShardSpec`); the actor and the reference each hold one.
- `actor.Actor`: the trained policy (PPO-style update, optimizer, checkpoints, HF export).
- `reference.Reference` / `AdapterOffReference`: the frozen reference policy.
- `from_config`: both built from a `PPOConfig` (the only place that reads the whole config).
- `fsdp`, `optim`, `vision`, `balance`: sharding, optimizer/schedule, image inputs, length balancing.
"""

from vlrl.workers.actor import Actor
from vlrl.workers.balance import balance_across_ranks, imbalance, inverse_permutation
from vlrl.workers.reference import AdapterOffReference, Reference
from vlrl.workers.sharded_model import ShardedModel, ShardSpec

__all__ = [
    "Actor",
    "AdapterOffReference",
    "Reference",
    "ShardSpec",
    "ShardedModel",
    "balance_across_ranks",
    "imbalance",
    "inverse_permutation",
]
