"""Command line: `python -m vlrl.trainer.main config=FILE.yaml key.sub=value ...`

--help                 every config key with its default and docstring
print_config=true      print the resolved config (after the file and overrides) and exit (true, True, 1)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from vlrl.config import ConfigError, PPOConfig

_sigterm_received = False  # set by `_raise_on_sigterm`
_cleanup_cut = False  # set by `_clean_up` when it stopped waiting for a step after SIGTERM
_cleanup_deadline: float | None = None  # monotonic time by which the clean-up after SIGTERM ends
# After SIGTERM the clean-up steps get this long together, so that the exit fits in the 30 s a
# scheduler (Slurm's KillWait, Kubernetes' grace period) usually leaves before SIGKILL.
SIGTERM_CLEANUP_S = 20.0


def _usage() -> str:
    from vlrl.config import PPOConfig
    from vlrl.config.loader import describe

    return (__doc__ or "") + "\nConfig keys (defaults):\n  " + "\n  ".join(describe(PPOConfig()))


def run(argv: list[str]) -> int:
    from vlrl.config.easyr1 import startup_notes
    from vlrl.config.loader import describe, given_keys, load_config

    if any(arg in ("-h", "--help") for arg in argv):
        print(_usage())
        return 0
    show = print_config_requested(argv)
    argv = [arg for arg in argv if not arg.startswith("print_config=")]
    config = load_config(argv)
    notes = startup_notes(config, given_keys(argv))
    if show:
        print("\n".join(describe(config)))
    for note in notes:
        print(f"[vlrl] config: {note}", file=sys.stderr, flush=True)
    # what each step computes, decided once from the keys (vlrl.algorithms.plan)
    print(f"[vlrl] step plan: {config.plan.describe()}", file=sys.stderr, flush=True)
    if show:
        return 0
    from vlrl.rollout.vllm_hooks import RUN_ID_ENV, SHM_DIR, new_run_id, run_cpu_shm_prefix
    from vlrl.trainer.summary import write_summary

    # This run's id: the rank workers name their CPU shared memory after it (vllm_hooks).
    run_id = os.environ[RUN_ID_ENV] = new_run_id()
    rollout = config.worker.rollout
    if config.trainer.device == "cpu" and rollout.name == "vllm" and rollout.tensor_parallel_size > 1:
        shm = os.path.join(SHM_DIR, run_cpu_shm_prefix(run_id))
        print(f"[vlrl] run id {run_id} (its vLLM CPU all-reduce shared memory: {shm}*)", file=sys.stderr)
    try:
        write_summary(_train(config, argv), config)
    finally:
        try:
            _clean_up(lambda: _write_ray_timeline(config.trainer.ray_timeline))
            _clean_up(_stop_ray)
        finally:
            _remove_shared_memory()
    return 0


def _train(config: PPOConfig, argv: list[str]) -> list[dict[str, float]]:
    """Build the trainer and train; when a rank worker dies or hangs, start new rank workers and
    resume from this run's latest checkpoint, up to `trainer.max_failures` times. Returns the history."""
    from vlrl.config.loader import load_config
    from vlrl.trainer.deadlines import RankHang
    from vlrl.trainer.ray_trainer import build_trainer
    from vlrl.trainer.ray_workers import WorkerDied

    failures = 0
    while True:
        trainer = build_trainer(config)
        try:
            return trainer.fit()
        except (WorkerDied, RankHang) as exc:
            if failures >= config.trainer.max_failures or _sigterm_received:
                raise
            failures += 1
            saved = trainer.checkpoints.saved
            print(f"[vlrl] {type(exc).__name__}: {exc}\n[vlrl] restart {failures} of trainer.max_failures="
                  f"{config.trainer.max_failures}: new rank workers, resuming from {saved or 'the start'}",
                  file=sys.stderr, flush=True)  # fmt: skip
            if saved is not None:
                config = load_config([*argv, f"trainer.load_checkpoint_path={saved}"])
        finally:
            _clean_up(trainer.close)  # a hung rank is killed here


def print_config_requested(argv: list[str]) -> bool:
    """`print_config=VALUE` read as a YAML boolean (true/True/1/yes print; false/0 train)."""
    import yaml

    values = [arg.split("=", 1)[1] for arg in argv if arg.startswith("print_config=")]
    if not values:
        return False
    raw = values[-1]
    value = yaml.safe_load(raw) if raw else False
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise ConfigError(f"print_config={raw!r} must be true or false")
    return bool(value)


def _write_ray_timeline(path: str | None) -> None:
    """`trainer.ray_timeline`: Ray's task timeline as a Chrome trace (open in chrome://tracing)."""
    import ray

    if path and ray.is_initialized():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        ray.timeline(filename=path)
        print(f"[vlrl] wrote the Ray timeline to {path}", file=sys.stderr, flush=True)


def _stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _clean_up(step: Callable[[], None]) -> None:
    """Run a clean-up step of the CLI. After SIGTERM it runs in a thread, waited for until the
    clean-up's deadline (SIGTERM_CLEANUP_S after its first step) and no longer once this run's
    own Ray processes are gone (a SIGTERM sent to the process group stops them too, and Ray's
    calls would then wait 60 s for their GCS and end the process with exit 1); the steps after a
    cut one are skipped, and `_exit_on_sigterm` ends the process without Ray's exit hooks."""
    global _cleanup_cut, _cleanup_deadline
    from vlrl.trainer.ray_workers import local_ray_stopped

    if not _sigterm_received:
        step()
        return
    if _cleanup_cut:
        return
    if _cleanup_deadline is None:
        _cleanup_deadline = time.monotonic() + SIGTERM_CLEANUP_S
    worker = threading.Thread(target=step, name="vlrl-clean-up", daemon=True)
    worker.start()
    while worker.is_alive():
        ray_gone = local_ray_stopped()
        if ray_gone or time.monotonic() > _cleanup_deadline:
            _cleanup_cut = True
            why = (
                "Ray's processes were stopped by the signal too"
                if ray_gone
                else f"over {SIGTERM_CLEANUP_S:.0f} s"
            )
            print(f"vlrl: clean-up cut short ({why}); ending the process", file=sys.stderr, flush=True)
            return
        worker.join(0.2)


def _remove_shared_memory() -> None:
    """Unlink the vLLM CPU all-reduce segments this run's ranks left on this machine (a rank
    killed before its engine closed: an error, SIGTERM); other runs' are never touched."""
    from vlrl.rollout.vllm_hooks import remove_run_cpu_shm

    removed = remove_run_cpu_shm()
    if removed:
        print(f"[vlrl] removed {len(removed)} shared-memory segment(s) this run's ranks left: "
              f"{', '.join(removed)}", file=sys.stderr, flush=True)  # fmt: skip


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM handler: the clean shutdown of Ctrl-C, so that `run`'s `finally` stops the workers
    and removes the run's shared memory, which the default action (the driver killed at once, the
    workers killed by Ray) would leave behind. It raises KeyboardInterrupt because that is what a
    blocking `ray.get` stops on (ray 2.60, python/ray/_raylet.pyx `check_signals`: any other
    exception from a handler surfaces as a SystemError). A second SIGTERM does not interrupt the
    shutdown. `start_ray` puts this handler back after `ray.init`, which installs Ray's own."""
    global _sigterm_received
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _sigterm_received = True
    print("vlrl: SIGTERM received: stopping the rank workers", file=sys.stderr, flush=True)
    raise KeyboardInterrupt


def _exit_on_sigterm() -> None:
    """After SIGTERM (whatever the exception it became): exit 143, as a process killed by it."""
    if _sigterm_received:
        print("vlrl: terminated by SIGTERM (exit 143); the rank workers are stopped and the latest complete "
              "checkpoint is kept", file=sys.stderr, flush=True)  # fmt: skip
        if _cleanup_cut:  # Ray's exit hook would wait for its GCS again; the OS ends what is left
            sys.stdout.flush()
            os._exit(143)
        sys.exit(143)  # 128 + SIGTERM


def _show_vlrl_logs() -> None:
    """vlrl's own log lines (rows loaded and filtered, reward workers started, warnings) on stderr,
    whatever the other libraries' logging does."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[vlrl] %(message)s"))
    package = logging.getLogger("vlrl")
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    package.propagate = False


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _show_vlrl_logs()
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        sys.exit(run(sys.argv[1:]))
    except ConfigError as exc:
        print(f"vlrl: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        # Workers and engines are stopped by the `finally` above; an interrupted save is a
        # `.tmp` folder that is never resumed from.
        _exit_on_sigterm()
        print("vlrl: interrupted; the latest complete checkpoint is kept", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 (show the cause, not a wall of traces; VLRL_DEBUG=1 shows all)
        _exit_on_sigterm()
        if os.environ.get("VLRL_DEBUG"):
            raise
        print(
            f"vlrl: training failed: {type(exc).__name__}: {exc}\n(set VLRL_DEBUG=1 for the full trace)",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
