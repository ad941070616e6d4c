"""Selective activation recomputation: one call whose output is recomputed in backward.

The code generator replaces an attention (or softmax) call in a stage's code by
`self.recompute_<node>(...)`, a `Recompute` module wrapping the same function:
its output and internals are not kept for backward but recomputed from its
inputs (Megatron-LM's selective recomputation of the attention core). Full
recomputation checkpoints whole layers instead (the stage's forward calls
torch.utils.checkpoint around each layer method).
"""

from __future__ import annotations

from typing import Callable

from torch import nn
from torch.utils.checkpoint import checkpoint


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
