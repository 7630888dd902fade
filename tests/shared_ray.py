"""One Ray cluster that the suite's CLI runs join through RAY_ADDRESS, as runs on a cluster do.

A run that starts its own local cluster spends ~10-15 s on it (its GCS, raylet and agents, then
waiting for the node); joined, it skips them. The cluster lives in a helper process started on
first use and stopped when the test session's process exits, so the test process itself never
becomes a Ray driver (in-process rank workers check `ray.is_initialized()`).

Runs that test the local cluster itself (Ctrl-C and SIGTERM stopping it, its session folders, a
killed run's process group) start their own: `e2e_helpers.start_cli` and the fault tests do.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys

# Logical CPUs: one per rank plus the driver's tasks; runs go one at a time.
NUM_CPUS = 8
_HELPER = """
import json, os, sys, ray
ray.init(num_cpus=int(sys.argv[1]), include_dashboard=False, log_to_driver=False)
address = ray.get_runtime_context().gcs_address
print(json.dumps({"address": address, "auth_mode": os.environ.get("RAY_AUTH_MODE")}), flush=True)
sys.stdin.read()  # until the test session closes it
ray.shutdown()
"""
_helper: subprocess.Popen[str] | None = None
_address = ""


def address() -> str:
    """The shared cluster's GCS address (host:port), starting the cluster on first use."""
    global _helper, _address
    if _helper is None or _helper.poll() is not None:
        # without the warm-rank hook: the helper's own job starts no workers, so no zygote for it
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("RAY_ADDRESS", "RAY_RUNTIME_ENV_HOOK")
        }
        _helper = subprocess.Popen(
            [sys.executable, "-c", _HELPER, str(NUM_CPUS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip
        assert _helper.stdout is not None
        line = _helper.stdout.readline()
        if not line:
            raise RuntimeError(f"the shared Ray cluster did not start (exit {_helper.wait()})")
        started = json.loads(line)
        _address = started["address"]
        if started["auth_mode"]:
            # A local cluster turns token authentication on when ~/.ray/auth_token exists, by
            # RAY_AUTH_MODE=token in its processes (ray 2.60, ray/_private/authentication/
            # authentication_token_setup.py); a driver joining it needs the same, or the GCS refuses it.
            # Ray's C++ settings in this process follow, as `ray.init` does for a cluster it starts
            # (ray 2.60, authentication_token_setup.py `_enable_token_auth`: `Config.initialize("")`):
            # a cluster a test starts here later (test_rank_group.py) reaches its GCS only then.
            os.environ["RAY_AUTH_MODE"] = started["auth_mode"]
            from ray._raylet import Config

            Config.initialize("")
        atexit.register(_stop, _helper)
    return _address


def _stop(helper: subprocess.Popen[str]) -> None:
    if helper.poll() is None:
        assert helper.stdin is not None
        helper.stdin.close()
        try:
            helper.wait(timeout=60)
        except subprocess.TimeoutExpired:
            helper.kill()
