"""Per-rank compute: the FSDP2 actor and reference policy, and their building blocks.

- `actor.Actor`: the trained policy (log-probs, PPO-style update, checkpoints, HF export).
- `reference.Reference`: the frozen reference policy.
- `fsdp`, `optim`, `vision`, `balance`: sharding, optimizer/schedule, image inputs, length balancing.
"""

from vlrl.workers.actor import Actor
from vlrl.workers.balance import balance_across_ranks, imbalance, inverse_permutation
from vlrl.workers.reference import Reference, ShardedModel

__all__ = ["Actor", "Reference", "ShardedModel", "balance_across_ranks", "imbalance", "inverse_permutation"]
