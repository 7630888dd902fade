"""Ray's rank workers started warm: forked from one process that imported their modules once.

Every CLI run in the suite starts one to four rank workers, and each spent ~13 s of CPU (idle
machine) importing torch, transformers, vLLM, Ray and vlrl before its first call, and a few more
importing vLLM's engine and model modules while building its engine. Here a helper process (the
"rank zygote", started on first use, ended when the test session's process ends) imports them
once; one per set of a job's environment variables (see `hook`). Ray starts a worker with
`py_executable` + `default_worker.py ARGS`; the suite's `py_executable` (set by `hook`, which Ray
calls from `ray.init` in every driver through `RAY_RUNTIME_ENV_HOOK`) is this file as a small
client. The client sends the worker's argv, folder, environment and standard streams (the
descriptors themselves) to the zygote, which forks a supervisor, which forks the worker: the same
`default_worker.py` run as `__main__`, in a process that already holds the modules.

Lifetimes, as Ray expects them of the process it started (the client):
- the worker registers with Ray under its own pid, so Ray's kills (and the tests' `os.kill` of a
  rank's reported pid) reach the worker itself;
- the client waits for the worker's exit status (the supervisor sends it) and ends the same way:
  the same exit code, or killed by the same signal; SIGTERM, SIGINT and SIGHUP sent to the client
  are passed on to the worker;
- a worker whose client died (a kill of the driver's process group takes the client with it)
  exits at once: it watches the connection, which only the client's end keeps open.

Nothing in the zygote starts a thread, a Ray connection or a torch computation before it forks
(imports only; it refuses to serve if an import started a Python thread).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SOCKET_ENV = "VLRL_TEST_RANK_ZYGOTE"
"""Where the zygotes' Unix sockets go (a path; each zygote's adds a key); when unset, `hook`
leaves Ray's workers as they are. In a worker's environment: its zygote's socket."""
OWNER_ENV = "VLRL_TEST_RANK_ZYGOTE_OWNER"
"""The pid of the test session's process: the zygote ends when it does."""
START_WAIT_S = 300.0  # the zygote's imports on a loaded 2-core machine

# What a rank worker imports: its own module, then what vLLM loads while it builds an engine (the
# modules a rank of tests/trainer/test_e2e_video.py loaded beyond these took 1.6 s more, Ray's included).
PRELOAD = (
    "torch",
    "transformers",
    "vllm",
    "vlrl.workers.rank_worker",
    "vlrl.rollout.vllm_engine",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.models.qwen2_vl",
    "vllm.model_executor.models.qwen2_5_vl",
    "vllm.model_executor.models.qwen3_vl",
)


def hook(runtime_env: dict[str, Any] | None) -> dict[str, Any] | None:
    """Ray's runtime-env hook: the job's workers start through this file when a zygote is named.

    One zygote per set of job variables (`env_vars`): some are read when a library is imported
    (vLLM configures its logger at import from VLLM_LOGGING_LEVEL, which a run sets from
    VLRL_DEBUG; torch reads TORCH_CPP_LOG_LEVEL), so a worker forked from a zygote that imported
    under another run's variables would log as that run."""
    if not os.environ.get(SOCKET_ENV):
        return runtime_env
    env_vars = dict((runtime_env or {}).get("env_vars") or {})
    key = hashlib.sha256(json.dumps(env_vars, sort_keys=True).encode()).hexdigest()[:12]
    path = f"{os.environ[SOCKET_ENV]}.{key}"
    ensure_zygote(path, env_vars)  # started now, it imports while Ray places the ranks
    return {
        **(runtime_env or {}),
        "env_vars": {**env_vars, SOCKET_ENV: path},
        "py_executable": f"{sys.executable} {__file__}",
    }


def ensure_zygote(path: str, env_vars: dict[str, str] | None = None) -> None:
    """Start the zygote for `path` unless one serves it (or is starting): one at a time, by a lock.
    It runs in this process's environment with `env_vars` on top."""
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = Path(path + ".pid")
        if started.exists() and _alive(int(started.read_text() or 0)):
            return
        log = open(path + ".log", "ab")  # noqa: SIM115 (the zygote's own output, kept for a failure)
        proc = subprocess.Popen(
            [sys.executable, __file__, "--zygote", path], stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env_vars or {})},
        )  # fmt: skip
        started.write_text(str(proc.pid))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (ended, not yet reaped by whoever started it) counts as ended
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    return True


# --- the request: a 4-byte length, then JSON, sent with the worker's 3 standard streams -----------
# (the answers go back as JSON lines: the worker's pid, then its wait status)


def _send_request(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    data = json.dumps(request).encode()
    frame = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(conn, [frame], fds)
    conn.sendall(frame[sent:])


def _receive_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("a rank zygote client closed before its request was whole")
        data += more
    return json.loads(data[4:]), list(fds)


# --- the client: what Ray starts -------------------------------------------------------------------


def client_main(argv: list[str]) -> None:
    """Hand this worker's start to the zygote; wait for the worker; end as it ended."""
    path = os.environ[SOCKET_ENV]
    conn = _connect(path)
    _send_request(conn, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}, fds=[0, 1, 2])
    answers = conn.makefile("rb")
    line = answers.readline()
    if not line:
        sys.exit(f"the rank zygote closed before starting the worker (its log: {path}.log)")
    worker = int(json.loads(line)["pid"])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda number, _frame: os.kill(worker, number))
    line = answers.readline()
    if not line:
        sys.exit(f"the rank zygote's supervisor ended before the worker (its log: {path}.log)")
    status = int(json.loads(line)["status"])
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    sys.exit(os.waitstatus_to_exitcode(status))


def _connect(path: str) -> socket.socket:
    deadline = time.monotonic() + START_WAIT_S
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if time.monotonic() > deadline:
                raise
            ensure_zygote(path)  # a zygote that died is started again
            time.sleep(0.2)


# --- the zygote, its supervisors and the workers -----------------------------------------------------


def zygote_main(path: str, modules: tuple[str, ...] = PRELOAD) -> None:
    """Import `modules`, then fork a supervisor per connection until the test session ends."""
    import importlib

    blocker = _RayKeptOut()
    sys.meta_path.insert(0, blocker)
    for name in modules:
        importlib.import_module(name)
    sys.meta_path.remove(blocker)
    # (OpenBLAS starts its idle thread pools at load, numpy's and torch's: it re-creates them in a
    # forked child by its own pthread_atfork handlers; OPENBLAS_NUM_THREADS=1 shows they are the only ones)
    if threading.active_count() != 1:
        sys.exit(f"an import started a thread ({threading.enumerate()}); forking would copy its locks")
    owner = int(os.environ.get(OWNER_ENV, "0"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(5.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    while owner == 0 or _alive(owner):
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        if os.fork() == 0:
            listener.close()
            _supervise(conn)  # never returns
        conn.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _supervise(conn: socket.socket) -> None:
    """Fork the worker, tell the client its pid, then its exit status."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # waitpid below needs its child's status
        conn.settimeout(None)
        request, fds = _receive_request(conn)
        if len(fds) != 3:
            raise ConnectionError("a rank zygote client sent no worker request")
        pid = os.fork()
        if pid == 0:
            _become_worker(request, fds, conn)  # never returns
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(BrokenPipeError):  # a killed client waits for nothing
            conn.sendall(json.dumps({"status": status}).encode() + b"\n")
        code = 0
    except BaseException:  # noqa: BLE001 (the supervisor ends either way; its trace goes to the zygote's log)
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _become_worker(request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
    """Take the client's streams, folder, environment and argv; watch the client; run the worker."""
    code = 1
    try:
        os.setsid()  # apart from the zygote's group: a kill of one worker's group is its own
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own streams)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _import_ray()
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python SCRIPT` puts it
        threading.Thread(target=_exit_with_client, args=(conn,), daemon=True, name="zygote-client").start()
        import runpy

        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 (the worker's own crash: its trace goes to its stderr)
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


class _RayKeptOut:
    """An import finder that refuses `ray` while the zygote imports (see `zygote_main`)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"{name} is imported by each worker itself, not by the rank zygote")


def _import_ray() -> None:
    """Import Ray in the worker, from its own environment, and give vLLM's Ray helpers it.

    Ray's C++ settings are read from the environment once per process, when Ray loads: RayConfig
    (every `RAY_<setting>`, the job id `RAY_JOB_ID`) and the authentication mode and token (a local
    cluster turns token authentication on with `RAY_AUTH_MODE=token` when ~/.ray/auth_token
    exists). A worker forked with the zygote's copies is refused by the GCS ("Authentication token
    is missing") or stops on "Check failed: !job_id_env.empty()" (ray 2.60, core_worker.cc
    `GetProcessJobID`). So the zygote keeps Ray out; the one module that reached for it,
    vllm/v1/executor/ray_utils.py (`try: import ray ... except ImportError`), is loaded again here
    with Ray present, as a cold worker has it."""
    import importlib

    import ray  # noqa: F401 (loaded here, with this worker's settings)

    helpers = sys.modules.get("vllm.v1.executor.ray_utils")
    if helpers is not None:
        importlib.reload(helpers)


def _exit_with_client(conn: socket.socket) -> None:
    """End this worker when its client's end of the connection closes (the client was killed)."""
    with contextlib.suppress(OSError):
        while conn.recv(1):
            pass
    os._exit(1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        zygote_main(sys.argv[2], tuple(sys.argv[3:]) or PRELOAD)
    else:
        client_main(sys.argv[1:])
