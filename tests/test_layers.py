"""Layers import one way: nothing low imports the trainer, and no import cycle hides in a function.

Read from the source (every `import`, at module level or inside functions), so a new upward import
fails here before it becomes a cycle at run time."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "vlrl"

# package -> packages it must never import (directly or inside a function)
FORBIDDEN = {
    "utils": {"data", "rollout", "rewards", "workers", "trainer", "tools", "models", "algorithms"},
    "batch": {"data", "rollout", "rewards", "workers", "trainer", "tools", "models", "algorithms"},
    "models": {"data", "rollout", "rewards", "workers", "trainer", "tools"},
    "algorithms": {"data", "rollout", "rewards", "workers", "trainer", "tools"},
    "data": {"rollout", "rewards", "workers", "trainer", "tools"},
    "rewards": {"rollout", "workers", "trainer", "tools"},
    "rollout": {"rewards", "workers", "trainer", "tools"},
    "workers": {"trainer", "tools"},
    "config": {"workers", "trainer", "tools", "rewards"},
    # user files in child processes, shared by rewards and multi-turn tools: below both
    "user_code": {
        "data",
        "rollout",
        "rewards",
        "workers",
        "trainer",
        "tools",
        "models",
        "algorithms",
        "batch",
    },
}
# Known upward imports, to move: a new one fails, and one that is gone must be removed from here.
KNOWN: set[tuple[str, str]] = set()


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _names(node: ast.AST, in_function: bool = False) -> Iterator[tuple[str, bool]]:
    """(imported dotted name, inside a function) of every import under `node`, not counting
    `if TYPE_CHECKING:` blocks (annotations only) and relative imports."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue
        if isinstance(child, ast.Import):
            yield from ((alias.name, in_function) for alias in child.names)
        elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
            yield from ((f"{child.module}.{alias.name}", in_function) for alias in child.names)
        yield from _names(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))


def _imports() -> tuple[set[str], dict[str, set[str]], dict[str, set[str]]]:
    """(modules, module-level imports, imports inside functions) among vlrl's modules."""
    modules = {_module(p) for p in ROOT.rglob("*.py")}
    top: dict[str, set[str]] = defaultdict(set)
    lazy: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        module = _module(path)
        for name, in_function in _names(ast.parse(path.read_text())):
            while name and name not in modules:  # `from pkg.mod import f` -> pkg.mod
                name = name.rpartition(".")[0]
            if name.startswith("vlrl") and name != module:
                (lazy if in_function else top)[module].add(name)
    return modules, top, lazy


def test_no_package_imports_a_layer_above_it() -> None:
    _, top, lazy = _imports()
    found = set()
    for table in (top, lazy):
        for module, targets in table.items():
            for other in targets:
                if other.split(".")[1] in FORBIDDEN.get(module.split(".")[1], ()):
                    found.add((module, other))
    assert sorted(found - KNOWN) == [], "upward imports"
    assert sorted(KNOWN - found) == [], "moved: remove them from KNOWN"


def test_no_import_cycle_hides_inside_a_function() -> None:
    """A function-level import of B from A where B's module-level imports reach A: a cycle that
    only works because one side waits (a package importing its own submodules is not one)."""
    modules, top, lazy = _imports()

    def reaches(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for nxt in top[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    cycles = [
        (module, other)
        for module in sorted(modules)
        for other in sorted(lazy[module])
        if module in reaches(other) and not other.startswith(module + ".")
    ]
    assert cycles == []
