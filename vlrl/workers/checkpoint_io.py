"""Checkpoint files that load without running code from the file, and optimizer state placement.

A checkpoint may come from elsewhere (a shared folder, a download), so nothing in it may execute
code when loaded:
- the per-rank extra state (LR schedule, counters, RNG streams) holds only tensors, numbers,
  strings and plain containers, and is read with `torch.load(weights_only=True)`;
- torch.distributed.checkpoint's own `FileSystemReader.read_metadata` (torch 2.13,
  torch/distributed/checkpoint/filesystem.py) reads the `.metadata` file with a bare
  `pickle.load`. `SafeFileSystemReader` reads it with an unpickler that only builds the classes
  DCP metadata is made of. (The data files' non-tensor entries are already read with
  `torch.load(weights_only=True)` by the same reader.)

Optimizer state: `Optimizer.load_state_dict` (torch 2.13, torch/optim/optimizer.py,
`_process_value_according_to_param_policy`) casts every floating state tensor except `step` to
its parameter's dtype and device. That turns `AdamWBf16`'s bf16 moments into fp32 (twice the
memory) and puts states kept on CPU onto the parameter's GPU. `state_placement` /
`restore_state_placement` put them back as they were.
"""

from __future__ import annotations

import enum
import io
import pickle
import random
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

# ------------------------------------------------------------------ DCP metadata, safely


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what a DCP `.metadata` file holds: its dataclasses, torch sizes/dtypes, paths."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__:
            value = getattr(dcp_metadata, name, None)
            if isinstance(value, type) and (
                hasattr(value, "__dataclass_fields__") or issubclass(value, enum.Enum)
            ):
                return value
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which a torch.distributed.checkpoint "
            "metadata file never holds; refusing to load it (the file may have been tampered with)"
        )


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose metadata is read without executing arbitrary pickled code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold torch.distributed.checkpoint metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


# ------------------------------------------------------------------ per-rank extra state


def save_extra_state(path: str, extra: dict[str, Any]) -> None:
    """`torch.save` a dict of tensors / numbers / strings / plain containers (checked on load)."""
    torch.save(extra, path)


def load_extra_state(path: str) -> dict[str, Any]:
    """Read what `save_extra_state` wrote; refuses anything but tensors and plain values."""
    return torch.load(path, weights_only=True, map_location="cpu")


def rng_state() -> dict[str, Any]:
    """Every RNG stream as tensors and plain values (loadable with `weights_only=True`)."""
    version, mt_words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": list(mt_words), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(
                np.asarray(keys, dtype=np.int64)
            ),  # uint32 words; int64 holds them exactly
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ------------------------------------------------------------------ optimizer state placement

Placement = dict[int, dict[str, tuple[torch.dtype, torch.device]]]


def state_placement(optimizer: torch.optim.Optimizer) -> Placement:
    """(dtype, device) of every optimizer state tensor, by parameter index in the param groups."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out: Placement = {}
    for index, param in enumerate(params):
        state = optimizer.state.get(param, {})
        out[index] = {k: (v.dtype, v.device) for k, v in state.items() if isinstance(v, torch.Tensor)}
    return out


def restore_state_placement(optimizer: torch.optim.Optimizer, placement: Placement) -> None:
    """Cast/move optimizer state tensors back to `placement` (undoes `load_state_dict`'s recast)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        state = optimizer.state.get(param, {})
        for key, (dtype, device) in placement.get(index, {}).items():
            value = state.get(key)
            if isinstance(value, torch.Tensor) and (value.dtype != dtype or value.device != device):
                state[key] = value.to(device=device, dtype=dtype)
