"""Checkpoint files run no pickled code when loaded; RNG state round-trips; optimizer placement."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from vlrl.workers.checkpoint_io import (
    SafeFileSystemReader,
    load_extra_state,
    restore_state_placement,
    rng_state,
    save_extra_state,
    set_rng_state,
    state_placement,
)


class _Exploit:
    """Unpickling this creates a marker file: proof that the loader ran code from the file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_extra_state_refuses_pickled_code(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "extra_state_rank0.pt"
    torch.save({"rng": _Exploit(str(marker))}, path)
    with pytest.raises(pickle.UnpicklingError):
        load_extra_state(str(path))
    assert not marker.exists()


def test_rng_state_round_trips_through_weights_only(tmp_path: Path) -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.normal()  # a cached gaussian is part of numpy's state
    path = tmp_path / "extra.pt"
    save_extra_state(str(path), {"rng": rng_state(), "global_step": 4})
    expected = (random.random(), np.random.normal(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(load_extra_state(str(path))["rng"])
    got = (random.random(), np.random.normal(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def _save_dcp(folder: Path) -> dict:
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3).to(torch.bfloat16)}, "meta": {"lr": 0.5}}
    dcp.save(state, checkpoint_id=str(folder))
    return state


def test_safe_reader_loads_a_real_checkpoint(tmp_path: Path) -> None:
    saved = _save_dcp(tmp_path)
    target = {"model": {"w": torch.zeros(2, 3, dtype=torch.bfloat16)}, "meta": {"lr": 0.0}}
    dcp.load(target, storage_reader=SafeFileSystemReader(str(tmp_path)))
    assert torch.equal(target["model"]["w"], saved["model"]["w"]) and target["meta"]["lr"] == 0.5


def test_safe_reader_refuses_tampered_metadata(tmp_path: Path) -> None:
    _save_dcp(tmp_path)
    marker = tmp_path / "ran"
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(_Exploit(str(marker)), f)
    target = {"model": {"w": torch.zeros(2, 3, dtype=torch.bfloat16)}, "meta": {"lr": 0.0}}
    with pytest.raises(CheckpointException, match="refusing to load"):  # DCP wraps the UnpicklingError
        dcp.load(target, storage_reader=SafeFileSystemReader(str(tmp_path)))
    assert not marker.exists()


def test_model_merger_reads_model_entries_safely(tmp_path: Path) -> None:
    from vlrl.tools.model_merger import load_full_model_state

    saved = _save_dcp(tmp_path)
    assert torch.equal(load_full_model_state(str(tmp_path))["w"], saved["model"]["w"])
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(_Exploit(str(tmp_path / "ran")), f)
    with pytest.raises(CheckpointException, match="refusing to load"):
        load_full_model_state(str(tmp_path))
    assert not os.path.exists(tmp_path / "ran")


def test_restore_state_placement_undoes_load_state_dict_recast() -> None:
    """torch's Optimizer.load_state_dict casts bf16 moments to the fp32 parameter's dtype."""
    from vlrl.config import OptimConfig
    from vlrl.workers.optim import build_optimizer

    param = torch.nn.Parameter(torch.randn(4))
    optimizer = build_optimizer([param], OptimConfig(strategy="adamw_bf16"))
    param.grad = torch.randn(4)
    optimizer.step()
    placement = state_placement(optimizer)
    before = {k: v.clone() for k, v in optimizer.state[param].items()}
    optimizer.load_state_dict(optimizer.state_dict())
    assert optimizer.state[param]["exp_avg"].dtype == torch.float32  # torch's recast (the defect)
    restore_state_placement(optimizer, placement)
    for key, value in before.items():
        assert optimizer.state[param][key].dtype == value.dtype
        assert torch.equal(optimizer.state[param][key], value)
