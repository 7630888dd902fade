"""Import a script of examples/ as a module (the scripts are not a package); tests import this
module by name because pytest puts tests/ (the directory of the root conftest.py) on sys.path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    """examples/<name>.py, executed once per test process (later calls return the same module)."""
    key = f"example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None, EXAMPLES / f"{name}.py"
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # before exec: dataclasses in the script look themselves up there
        spec.loader.exec_module(module)
    return sys.modules[key]
