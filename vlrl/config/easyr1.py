"""How vlrl's config tree relates to EasyR1's: aliases, deliberate default differences, and keys
accepted with no effect here. One table for each; `vlrl.config.loader` applies the aliases and
`startup_notes` turns the other two into the lines logged at start-up.

A key of EasyR1's tree is never silently ignored: it is a vlrl key (same name, same meaning), an
alias below (another name here), listed in `WITHOUT_EFFECT` (logged when set), in `NOT_IMPLEMENTED`
(a start-up error saying so), or rejected at start-up by `vlrl.config.checks` with a message saying why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlrl.config import ConfigError


@dataclass(frozen=True)
class Alias:
    """EasyR1's `name` is vlrl's `target`; `values` translates EasyR1 values that differ."""

    target: str
    values: dict[Any, Any] | None = None


ALIASES: dict[str, Alias] = {
    # EasyR1 calls the plain PPO clip loss `default`.
    "worker.actor.loss_type": Alias("worker.actor.policy_loss", {"default": "ppo"}),
    # EasyR1 reserves this many CPUs for its reward actor; vlrl runs one reward process per CPU.
    "worker.reward.num_cpus": Alias("worker.reward.num_workers"),
}

# key -> (EasyR1's default, why vlrl's default differs). vlrl's own default is read from the
# dataclasses, so it cannot drift from this table.
DELIBERATE_DEFAULTS: dict[str, tuple[Any, str]] = {
    "trainer.project_name": ("easy_r1", "this project's name; it also names the checkpoint folder"),
    "trainer.logger": (
        ["console", "wandb"],
        "wandb needs an account and a network; the file logger keeps metrics.jsonl next to the checkpoints",
    ),
    "worker.actor.model.trust_remote_code": (
        True,
        "running Python code shipped in a downloaded model folder should be an explicit choice "
        "(Qwen-VL models need none)",
    ),
    "worker.rollout.tensor_parallel_size": (
        2,
        "one rank per engine runs on any machine, including one GPU or CPU",
    ),
    "worker.actor.skip_steps_without_advantage": (
        False,
        "an all-zero-advantage mini-batch otherwise gets a full-size Adam step from its KL/entropy terms "
        "(see docs/algorithms.md); EasyR1 always steps",
    ),
    "worker.actor.use_torch_compile": (
        True,
        "compiling costs a minute or more at start-up and needs a C++ compiler on CPU; the compiled "
        "function (per-token log-probs) is a small share of a step",
    ),
}

# key -> why setting it changes nothing in vlrl. Logged when a config sets it.
WITHOUT_EFFECT: dict[str, str] = {
    "worker.actor.fsdp.use_orig_params": "FSDP2 always trains the original (unflattened) parameters",
    "worker.ref.fsdp.use_orig_params": "FSDP2 always keeps the original (unflattened) parameters",
    "worker.ref.strategy": "the reference is sharded like the actor (worker.actor.strategy)",
}

# EasyR1 keys of what vlrl does not implement: setting one stops the run at start-up with the reason
# (a key under a listed section counts too), rather than load and do nothing.
NOT_IMPLEMENTED: dict[str, str] = {
    "worker.critic": (
        "vlrl trains no critic (value model): EasyR1's algorithm.adv_estimator=gae is not implemented; "
        "the critic-free estimators (grpo, dr_grpo, rloo, reinforce_plus_plus, remax, grpo_passk) need no "
        "worker.critic section: remove it"
    ),
    "trainer.critic_warmup": "steps that train only the critic; vlrl trains no critic (see worker.critic): remove it",
    "algorithm.lam": "GAE's lambda; vlrl has no gae estimator (it needs a critic): remove it",
}


def resolve_aliases(tree: dict[str, Any], errors: list[str]) -> None:
    """Move every aliased key of a nested `tree` to its target, in place, translating values.

    Setting both names with different values is an error (appended to `errors`)."""
    for name, alias in ALIASES.items():
        found, value = _pop(tree, name)
        if not found:
            continue
        if alias.values is not None and isinstance(value, str | int | float | bool) and value in alias.values:
            value = alias.values[value]
        present, existing = _get(tree, alias.target)
        if present and existing != value:
            errors.append(
                f"{name}={value!r} and {alias.target}={existing!r} disagree: {name} is EasyR1's name for "
                f"{alias.target}; set one of them"
            )
            continue
        _put(tree, alias.target, value)


def reject_not_implemented(tree: dict[str, Any], errors: list[str]) -> None:
    """Remove every `NOT_IMPLEMENTED` key (or section) the nested `tree` sets, appending an error
    for each: the key and why."""
    for key, why in NOT_IMPLEMENTED.items():
        found, value = _pop(tree, key)
        if found:
            set_keys = sorted(_leaf_keys(value, key)) if isinstance(value, dict) and value else [key]
            errors.append(f"{', '.join(set_keys)}: {why}")


def _leaf_keys(node: dict[str, Any], prefix: str) -> list[str]:
    out = []
    for name, value in node.items():
        key = f"{prefix}.{name}"
        out.extend(_leaf_keys(value, key) if isinstance(value, dict) and value else [key])
    return out


def startup_notes(config: Any, given: set[str]) -> list[str]:
    """Lines for the start-up log: EasyR1 defaults that differ here (for keys the config left
    unset) and keys set in the config that have no effect here."""
    lines = []
    for key, (easyr1, why) in DELIBERATE_DEFAULTS.items():
        if key in given:
            continue
        ours = _attr(config, key)
        lines.append(f"{key} = {ours!r} (EasyR1's default: {easyr1!r}): {why}")
    for key, why in WITHOUT_EFFECT.items():
        if key in given:
            lines.append(f"{key} is set but has no effect: {why}")
    return lines


def _attr(config: Any, key: str) -> Any:
    node = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _get(tree: dict[str, Any], key: str) -> tuple[bool, Any]:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _pop(tree: dict[str, Any], key: str) -> tuple[bool, Any]:
    *path, last = key.split(".")
    present, parent = _get(tree, ".".join(path)) if path else (True, tree)
    if not present or not isinstance(parent, dict) or last not in parent:
        return False, None
    return True, parent.pop(last)


def _put(tree: dict[str, Any], key: str, value: Any) -> None:
    *path, last = key.split(".")
    node = tree
    for part in path:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key!r}: {part!r} is a value, not a section")
        node = child
    node[last] = value
