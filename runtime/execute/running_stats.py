"""BatchNorm running statistics averaged over the data ranks after every step.

Each data rank normalizes its own micro-batches, so its running mean and variance follow its
own samples; left alone, the ranks' statistics drift apart and a checkpoint would keep data
rank 0's. After each step every rank all-reduces its stages' running statistics over the
gradient axis (the data axis, or the GEMS pair) and divides by the group size (as timm's
distribute_bn does), so every rank, and the checkpoint, holds their mean. The single-process
reference (runtime/reference.py) walks each data rank's micro-batches from the step's starting
statistics and averages the same way, so the two agree.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.comm import DoneHandle, Group, Handle


def batchnorm_modules(module: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers of `module` that keep running statistics."""
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]


def statistics(mods: list[nn.Module]) -> list[list[torch.Tensor]]:
    """A copy of each layer's buffers (running mean, variance, batches tracked)."""
    return [[b.detach().clone() for b in m.buffers(recurse=False)] for m in mods]


def load_statistics(mods: list[nn.Module], state: list[list[torch.Tensor]]) -> None:
    """Put buffers saved by `statistics` back."""
    with torch.no_grad():
        for m, saved in zip(mods, state):
            for b, v in zip(m.buffers(recurse=False), saved):
                b.copy_(v)


class _Average:
    def __init__(self, handle: Handle, flat: torch.Tensor, tensors: list[torch.Tensor], size: int):
        self._handle, self._flat, self._tensors, self._size = handle, flat, tensors, size

    def wait(self) -> None:
        self._handle.wait()
        self._flat.div_(self._size)
        off = 0
        for t in self._tensors:
            n = t.numel()
            t.copy_(self._flat[off:off + n].view_as(t))
            off += n

    def on_complete(self, fn) -> None:
        self._handle.on_complete(fn)


class RunningStats:
    """The running statistics (StageSpec.running_stats) of a rank's stages, and their group."""

    def __init__(self, specs: dict, modules: dict[int, nn.Module], group: Group):
        self._group = group
        self._tensors: dict[int, list[torch.Tensor]] = {}
        for s, sp in specs.items():
            # under sub-graph parallelism a rank holds only its sub-grid's paths; the ranks of its
            # group (same sub-grid) hold the same ones
            named = dict(modules[s].named_buffers())
            self._tensors[s] = [named[n] for n in sp.running_stats if n in named]

    def launch(self, stage: int) -> Handle:
        tensors = self._tensors[stage]
        if not tensors:
            return DoneHandle()
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        return _Average(self._group.all_reduce(flat, async_op=True), flat, tensors, self._group.size)
