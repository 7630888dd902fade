"""Structure of vlrl.workers: the actor and the reference hold a ShardedModel (no shared base
class), and none of them reads the whole PPOConfig (vlrl.workers.from_config hands them their parts)."""

from __future__ import annotations

import ast
import inspect

import vlrl.workers.actor as actor_module
import vlrl.workers.reference as reference_module
import vlrl.workers.sharded_model as sharded_module
from vlrl.workers import Actor, AdapterOffReference, Reference, ShardedModel


def test_no_implementation_inheritance() -> None:
    for cls in (Actor, Reference, AdapterOffReference, ShardedModel):
        assert cls.__mro__ == (cls, object), cls.__mro__


def test_the_models_never_see_ppo_config() -> None:
    for module in (actor_module, reference_module, sharded_module):
        tree = ast.parse(inspect.getsource(module))
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        names |= {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names}
        assert "PPOConfig" not in names, module.__name__
