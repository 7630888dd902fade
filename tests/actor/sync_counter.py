"""Count host-device synchronizations on a CPU-only run (for tests/actor/test_update_syncs.py).

On a GPU, the host waits for every queued kernel when it reads a device tensor (`.item()`,
`float()`, `int()`, `bool()`, `.tolist()`, `.cpu()`, `.numpy()`, copying one into a host tensor),
when an op's output shape depends on device data (`nonzero`, boolean-mask indexing,
`masked_select`, `unique`, `bincount`, `repeat_interleave` with tensor repeats), and on a blocking
host-to-device copy (`.to(device)` without `non_blocking=True`).

On CPU every tensor is a host tensor, so `SyncCounter` tracks which ones *would* live on the device
(a taint): a tensor is a device tensor when it is
- a parameter of the model, or a DTensor (FSDP's shards and gradients),
- the result of `Tensor.to(DEVICE)` / `.to(a device tensor)` of a host tensor (made a real copy with
  `clone` when `to` returns its input, as a GPU copy would be),
- created by a factory given `device=DEVICE`,
- or the output of any torch function one of whose tensor arguments is a device tensor.
`DEVICE` is the model's `torch.device` object itself (compared by identity): the code under test
passes it around, while `.cpu()` / `.to("cpu")` / host factories use other objects.

Known blind spots: a device-to-host copy written as `.to(torch.device("cpu"))` of a device tensor
counts as device-to-device; ops that never go through `__torch_function__` (the autograd engine's
C++ backward) are not seen.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

# reads of a device tensor's values by the host
READS = {
    Tensor.item,
    Tensor.tolist,
    Tensor.__float__,
    Tensor.__int__,
    Tensor.__bool__,
    Tensor.__index__,
    Tensor.cpu,
    Tensor.numpy,
}
# ops whose output shape depends on the values of a device tensor
DATA_DEPENDENT = {
    torch.nonzero,
    Tensor.nonzero,
    torch.argwhere,
    Tensor.argwhere,
    torch.masked_select,
    Tensor.masked_select,
    torch.unique,
    Tensor.unique,
    torch.unique_consecutive,
    Tensor.unique_consecutive,
    torch.bincount,
    Tensor.bincount,
}
INDEXING = {Tensor.__getitem__, Tensor.__setitem__, Tensor.index_put_, Tensor.index_put, torch.index_put}
TO = {Tensor.to}


class SyncCounter(TorchFunctionMode):
    """`with SyncCounter(device, module) as c:` ... then `c.counts` (by kind; `model_*` when the sync is
    inside the Hugging Face model's own code) and `c.where` (by the innermost vlrl line that caused it)."""

    def __init__(self, device: torch.device, module: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.device = device
        self.marked: WeakIdKeyDictionary = WeakIdKeyDictionary()
        if module is not None:
            for t in [*module.parameters(), *module.buffers()]:
                self.marked[t] = True
        self.counts: Counter[str] = Counter()
        self.where: Counter[str] = Counter()

    def __enter__(self):
        # DTensor.to_local / full_tensor run an autograd Function that the mode does not see:
        # their outputs (a shard, a gathered gradient norm) stay device tensors
        self._saved = {name: getattr(DTensor, name) for name in ("to_local", "full_tensor")}
        for name, method in self._saved.items():
            setattr(DTensor, name, self._marking(method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(DTensor, name, method)
        return super().__exit__(*exc)

    def _marking(self, method):
        def wrapped(*args, **kwargs):
            out = method(*args, **kwargs)
            self._mark(out)
            return out

        return wrapped

    # ----------------------------------------------------------------------------- residency
    def on_device(self, x: Any) -> bool:
        return isinstance(x, Tensor) and (x in self.marked or isinstance(x, DTensor))

    def _mark(self, out: Any) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self.marked[t] = True

    def _count(self, kind: str, func: Any) -> None:
        stack = traceback.extract_stack()
        if any("/site-packages/transformers/" in f.filename for f in stack):
            kind = f"model_{kind}"  # inside the Hugging Face model's own code
        self.counts[kind] += 1
        frames = [f for f in stack if "/vlrl/" in f.filename]
        name = getattr(func, "__name__", str(func))
        at = (
            f"{frames[-1].filename.split('/vlrl/')[-1]}:{frames[-1].lineno} {frames[-1].line}"
            if frames
            else ""
        )
        self.where[f"{kind} {name} {at}"] += 1

    # ----------------------------------------------------------------------------- dispatch
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tensor)]
        tainted = any(self.on_device(a) for a in flat)
        if func in TO and args and isinstance(args[0], Tensor):
            return self._to(func, args, kwargs)
        self._classify(func, args, kwargs, tainted)
        out = func(*args, **kwargs)
        if func in READS:  # the result is on the host (the read was the sync): a copy, as on a GPU
            return out.clone() if out is args[0] else out
        if tainted or kwargs.get("device") is self.device:
            self._mark(out)
        return out

    def _classify(self, func, args, kwargs, tainted: bool) -> None:
        if func in READS and self.on_device(args[0]):
            self._count("read", func)
        elif func in DATA_DEPENDENT and tainted:
            self._count("data_dependent", func)
        elif func in (torch.repeat_interleave, Tensor.repeat_interleave) and tainted:
            if (
                isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), Tensor)
                and "output_size" not in kwargs
            ):
                self._count("data_dependent", func)
        elif func in INDEXING:
            self._indexing(func, args)
        elif func is torch.where and len(args) == 1 and tainted:
            self._count("data_dependent", func)

    def _indexing(self, func, args) -> None:
        target, index = args[0], args[1]
        indices = [t for t in tree_flatten(index)[0] if isinstance(t, Tensor)]
        boolean = any(t.dtype == torch.bool for t in indices)
        if boolean and (self.on_device(target) or any(self.on_device(t) for t in indices)):
            self._count("data_dependent", func)
        if func is Tensor.__setitem__ and not self.on_device(target) and self.on_device(args[2]):
            self._count("read", func)  # a device value written into a host tensor: a device-to-host copy

    def _to(self, func, args, kwargs):
        src = args[0]
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        to_device = target is self.device or self.on_device(target)
        out = func(*args, **kwargs)
        if self.on_device(src):
            self._mark(out)
        elif to_device:
            if not kwargs.get("non_blocking", False):
                self._count("blocking_h2d", func)
            out = out.clone() if out is src else out
            self._mark(out)
        return out
