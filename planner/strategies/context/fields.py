"""Context parallelism's ParallelConfig fields (planner/strategies/field_hooks.py): `context` (ranks per
sequence) and `context_attention` (the attention exchange: ring or Ulysses)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.strategies.field_hooks import FieldFlag, StrategyFields
from runtime.vocab import StrategyName

if TYPE_CHECKING:
    from planner.config_fields import ConfigFields


class ContextFields(StrategyFields):
    name = StrategyName.CONTEXT
    flags = (FieldFlag("context", "context-parallel degree: ranks sharing each sequence (every layer's tokens split)"),
             FieldFlag("context_attention",
                       "how attention reaches the other ranks' keys and values: ring or ulysses (all-to-all)"))
    title = "context parallelism"
    off_setting = "context=1"
    # context_parallel's dispatch table (torch/distributed/tensor/experimental/_context_parallel/_attention.py,
    # torch 2.13) holds only aten._scaled_dot_product_{flash,efficient,cudnn}_attention and their backwards,
    # and its rotate methods pass key/value blocks around a ring (all-gather or all-to-all): no head split.
    torch_gap = ("torch.distributed.tensor.experimental.context_parallel swaps in ring attention only for the CUDA "
                 "flash, memory-efficient and cuDNN scaled_dot_product_attention kernels (not the CPU kernel, nor "
                 "attention written as matmul and softmax) and has no Ulysses head split, so it does not carry out "
                 "meshplan's context-parallel plans")

    def refusal(self, c: "ConfigFields") -> str | None:
        """The attention exchange is chosen only where there is a context axis."""
        if c.context == 1 and c.context_attention != "ring":
            return f"context_attention={c.context_attention!r} needs context >= 2 (ranks per sequence)"
        return None

    def unused(self, c: "ConfigFields") -> tuple[str, ...]:
        return ("context", "context_attention") if c.context == 1 else ()

    def label(self, c: "ConfigFields") -> str:
        return f" c{c.context} {c.context_attention}" if c.context > 1 else ""


__all__ = ["ContextFields"]
