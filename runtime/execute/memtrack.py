"""Peak memory of one training step on one rank: live tensor bytes on CPU, the allocator on GPU.

On CPU there is no allocator that reports a peak, so `LiveBytes` counts it:
a TorchDispatchMode sees every tensor an aten op returns (forward, backward,
optimizer, communication buffers) and adds its storage's bytes once; a
weakref finalizer on the storage takes them off when it is freed (storages
keep one Python object for their lifetime, so the finalizer runs exactly
when the memory goes). Tensors that exist before the step (parameters,
gradient buckets, optimizer state) are found once through the garbage
collector and counted the same way. Bytes are storage bytes: a view adds
nothing, a storage shared by several tensors counts once.

On GPU, torch.cuda.max_memory_allocated over the step (after resetting it).

Counting costs a Python call per op, so the executor measures one step
(the warm-up step) with it and times the others without it.
"""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class StepMemory:
    """Bytes on one rank: live when the step began, and the most live at once during it."""

    baseline: int
    peak: int
    method: str   # "live tensor bytes (CPU)" or "torch.cuda.max_memory_allocated"


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live CPU tensor storages while it is active (and after, for the
    storages it saw). `live` and `peak` are bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}   # storage data_ptr -> bytes

    def track(self, t: torch.Tensor) -> None:
        # Plain tensors and parameters only: subclasses such as FakeTensor or FunctionalTensor
        # (left alive by tracing) claim a device but own no memory.
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu" or t.is_meta:
            return
        try:
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse, fake (left by tracing) and other storage-less tensors
            return
        if nbytes == 0 or key in self._seen:
            return
        self._seen[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        if self._seen.get(key) == nbytes:
            del self._seen[key]
            self.live -= nbytes

    def track_existing(self) -> None:
        """Count every tensor alive now (found through the garbage collector)."""
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance reads __class__, which some module objects
            # answer with a deprecation warning.
            if issubclass(type(obj), torch.Tensor):
                self.track(obj)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out


@contextmanager
def _cuda_peak(device: torch.device) -> Iterator[Callable[[], StepMemory]]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    yield lambda: StepMemory(base, torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated")
    torch.cuda.synchronize(device)


def measure_step_memory(device: torch.device, run: Callable[[], object]) -> tuple[object, StepMemory]:
    """Run `run()` (one training step) and return (its result, the step's memory on this rank)."""
    if device.type == "cuda":
        with _cuda_peak(device) as read:
            out = run()
        return out, read()
    tracker = LiveBytes()
    gc.collect()
    tracker.track_existing()
    tracker.reset_peak()
    base = tracker.live
    with tracker:
        out = run()
    return out, StepMemory(base, tracker.peak, "live tensor bytes (CPU)")
