"""Selective activation recomputation: one call whose output is recomputed in backward.

The code generator replaces an attention (or softmax) call in a stage's code by
`self.recompute_<node>(...)`, a `Recompute` module wrapping the same function:
its output and internals are not kept for backward but recomputed from its
inputs (Megatron-LM's selective recomputation of the attention core). Full
recomputation checkpoints whole layers instead (the stage's forward calls
torch.utils.checkpoint around each layer method, with `keep_statistics(self)`
as its context_fn: a recomputed forward must not update BatchNorm's running
statistics a second time).
"""

from __future__ import annotations

import contextlib
from typing import Callable

from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.execute.running_stats import batchnorm_modules, load_statistics, statistics


class _RestoreStatistics:
    """Restores the running statistics of `modules` after the block it wraps (the recomputation)."""

    def __init__(self, modules: list[nn.Module]):
        self._modules = modules

    def __enter__(self):
        self._saved = statistics(self._modules)

    def __exit__(self, *exc):
        load_statistics(self._modules, self._saved)
        return False


def keep_statistics(module: nn.Module) -> Callable:
    """A torch.utils.checkpoint context_fn: the forward runs as usual; the recomputation in backward
    leaves the running statistics of `module`'s BatchNorm layers as the forward left them."""
    norms = batchnorm_modules(module)
    if not norms:
        return lambda: (contextlib.nullcontext(), contextlib.nullcontext())
    return lambda: (contextlib.nullcontext(), _RestoreStatistics(norms))


class Recompute(nn.Module):
    """Calls `fn(*args, **kwargs)` (or `args[0].<method>(*args[1:], **kwargs)`) under checkpoint."""

    def __init__(self, fn: Callable | None = None, method: str | None = None):
        super().__init__()
        if (fn is None) == (method is None):
            raise ValueError("Recompute needs exactly one of fn or method")
        self.fn = fn
        self.method = method

    def _call(self, *args, **kwargs):
        if self.fn is not None:
            return self.fn(*args, **kwargs)
        return getattr(args[0], self.method)(*args[1:], **kwargs)

    def forward(self, *args, **kwargs):
        return checkpoint(self._call, *args, use_reentrant=False, **kwargs)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__name__", None) or f".{self.method}()"
