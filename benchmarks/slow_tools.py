"""The demo's `reveal` tool answering after a delay, for `bench_multi_turn.py --tool-delay-ms`.

Same name, signature and docstring as `examples/tools/reveal.py:reveal` (so the same schema in the
prompt); it sleeps `VLRL_BENCH_TOOL_DELAY_MS` milliseconds first, as a slower tool (a sandbox, a
search, a simulator) would.
"""

import functools
import importlib.util
import os
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "reveal_tool", Path(__file__).resolve().parents[1] / "examples" / "tools" / "reveal.py"
)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)


@functools.wraps(_module.reveal)
def reveal(*args, **kwargs):
    time.sleep(float(os.environ.get("VLRL_BENCH_TOOL_DELAY_MS", "0")) / 1000)
    return _module.reveal(*args, **kwargs)
