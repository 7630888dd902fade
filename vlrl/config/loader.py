"""Build a `PPOConfig` from defaults, a YAML file and dotted command-line overrides.

    load_config(["config=examples/quickstart.yaml", "worker.rollout.n=8", "trainer.logger=[console]"])

Values in overrides are parsed as YAML (`8` is an int, `[a,b]` a list, `{"k": 1}` a dict, `null`
None). Unknown keys and wrong types raise one `ConfigError` listing every such key, each with the
nearest valid name. EasyR1's names for vlrl keys are aliases (`vlrl.config.easyr1.ALIASES`).
"""

from __future__ import annotations

import ast
import difflib
import inspect
import textwrap
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from vlrl.config import ConfigError, PPOConfig, _Section
from vlrl.config.easyr1 import reject_not_implemented, resolve_aliases


def load_config(argv: list[str], finalize: bool = True) -> PPOConfig:
    """Defaults <- `config=FILE` <- `a.b=value` overrides; then derive, validate and freeze.

    Every unknown key and wrong type of the file and the overrides is reported in one error."""
    errors: list[str] = []
    tree = read_tree(argv, errors)
    config = build_section(PPOConfig, tree, prefix="", errors=errors)
    if errors:
        raise ConfigError(f"{len(errors)} problem(s) in the config keys:\n  - " + "\n  - ".join(errors))
    return config.finalize() if finalize else config


def read_tree(argv: list[str], errors: list[str] | None = None) -> dict[str, Any]:
    """The nested dict of the YAML file with the overrides applied and EasyR1 aliases resolved."""
    tree: dict[str, Any] = {}
    overrides: list[tuple[str, Any]] = []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"argument {arg!r} is not of the form key=value (e.g. worker.rollout.n=8)")
        key, raw = arg.split("=", 1)
        if key == "config":
            tree = _read_yaml(raw)
        else:
            overrides.append((key, _parse_value(raw)))
    for key, value in overrides:
        _set_dotted(tree, key, value)
    resolve_aliases(tree, errors if errors is not None else [])
    reject_not_implemented(tree, errors if errors is not None else [])
    return tree


def given_keys(argv: list[str]) -> set[str]:
    """Dotted leaf keys that the file or the overrides set (after alias resolution)."""
    out: set[str] = set()

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value and prefix + key not in _DICT_FIELDS:
                walk(value, prefix + key + ".")
            else:
                out.add(prefix + key)

    walk(read_tree(argv), "")
    return out


# Leaves whose value is a mapping (not a section).
_DICT_FIELDS = {
    "worker.actor.model.override_config",
    "worker.rollout.val_override_config",
    "worker.reward.reward_function_kwargs",
}


def _read_yaml(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping at the top level")
    return data


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def build_section(cls: type, values: Any, prefix: str, errors: list[str] | None = None) -> Any:
    """Instantiate dataclass `cls` from a nested dict, checking keys and types.

    With `errors`, every problem is appended there (the field keeps its default) and building goes
    on; without, the first problem raises `ConfigError`."""
    collect: list[str] = [] if errors is None else errors
    if not isinstance(values, dict):
        collect.append(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {values!r}")
        values = {}
    known = {f.name: f for f in fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        if name not in known:
            collect.append(_unknown_key_message(prefix + name, name, list(known)))
            continue
        hint = hints[name]
        if isinstance(hint, type) and issubclass(hint, _Section):
            kwargs[name] = build_section(hint, value or {}, prefix + name + ".", collect)
            continue
        try:
            kwargs[name] = _coerce(value, hint, prefix + name)
        except ConfigError as exc:
            collect.append(str(exc))
    if errors is None and collect:
        raise ConfigError(collect[0])
    return cls(**kwargs)


def _unknown_key_message(full_key: str, key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = (
        f"; did you mean {full_key.rsplit('.', 1)[0] + '.' if '.' in full_key else ''}{close[0]}?"
        if close
        else ""
    )
    return f"unknown config key {full_key!r}{hint} (valid keys here: {', '.join(sorted(valid))})"


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against a type hint; allow int->float and scalar->list conveniences."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if hint is Any:
        return value
    if origin is list:
        if isinstance(value, tuple):
            value = list(value)
        if isinstance(value, str) and args and args[0] is str:
            value = [value]  # `trainer.logger=console` means [console]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping (e.g. {key}='{{\"k\": 1}}'), got {value!r}")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML reads `1e-3` as a string
            return float(value)
        except ValueError:
            pass
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{key} must be of type {hint.__name__}, got {value!r} ({type(value).__name__})")
    return value


# ------------------------------------------------------------------------------------ help text
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (the string literal after it)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = nxt.value.value.strip()
    return docs


def describe(config: Any, prefix: str = "") -> list[str]:
    """Lines `key = value  # doc` for every field of a config tree."""
    lines = []
    docs = field_docs(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):
            lines.extend(describe(value, prefix + f.name + "."))
        else:
            doc = docs.get(f.name, "")
            lines.append(f"{prefix}{f.name} = {value!r}" + (f"    # {doc}" if doc else ""))
    return lines
