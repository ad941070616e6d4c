"""Context parallelism at run time: the stage code's `context` attribute and the targets' chunks.

The stage code (written at build time, codegen/strategies/context/stage_code.py) calls `self.context` to take this
rank's tokens of each input sequence, their positions, and attention over the whole sequence
(runtime/parallel/context/attention.py). This module builds that attribute from the Program
(runtime.parallel.context.part.ContextShard): the context group (`degree` consecutive coordinates of the data
axis), and this rank's chunks of the causal load-balanced layout. The loss reads the targets in
the same order (`batches`).

Gradients need nothing of their own: every rank's loss is the mean over its tokens, scaled by
1/(data x context), and the data axis of the Program holds data x context ranks, so the gradient
all-reduce (or ZeRO's reduce-scatter, sharding over data x context) sums the context ranks'
partial gradients as it sums the data replicas', and the reported loss is averaged over both.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime.comm import Group
from runtime.comm.context import DistContext
from runtime.parallel.context.attention import context_attention
from runtime.parallel.context.layout import ContextLayout, chunk_layout
from runtime.data import Batch
from runtime.materialize import CONTEXT
from runtime.parallel.base import Modules, RuntimeStrategy, Specs
from runtime.parallel.context.part import ContextShard
from runtime.program import Program
from runtime.vocab import MeshAxis, StrategyName


class ContextRank:
    """What the stage code calls as `self.context`: this rank's chunks of each sequence.

    group: the context group (member i holds layout rank i); layout: this rank's chunks.
    """

    def __init__(self, group: Group, layout: ContextLayout):
        self.group = group
        self.layout = layout

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of a full sequence: (.., T, ..) on `dim` -> (.., T / degree, ..)."""
        return self.layout.take(x, dim)

    def positions(self, start: int = 0, *, device: torch.device | str | None = None) -> torch.Tensor:
        """LongTensor (T / degree,): the positions of this rank's tokens (plus `start`), as
        torch.arange(start, start + T) would give them for the whole sequence."""
        return self.layout.positions().to(device) + start

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, mode: str,
                  scale: float | None = None) -> torch.Tensor:
        """q, k, v (B, H, T / degree, D) -> (B, H, T / degree, D): attention over the whole sequence."""
        return context_attention(q, k, v, self.group, self.layout, causal=causal, mode=mode, scale=scale)


class ContextBatches:
    """A rank's batch source whose targets are taken in its layout order (dimension `dim`); the
    inputs stay whole, since the stage code takes them itself."""

    def __init__(self, source: Any, layout: ContextLayout, dim: int):
        self.source = source
        self.layout = layout
        self.dim = dim

    def micro_batches(self, step: int) -> list[Batch]:
        return [(inputs, self.layout.take(targets, self.dim)) for inputs, targets in self.source.micro_batches(step)]

    def __getattr__(self, name: str):
        return getattr(self.source, name)   # global_batch, epoch_of, ...: the source's


def _layout(program: Program, shard: ContextShard) -> ContextLayout:
    return chunk_layout(shard.seq_len, shard.degree, shard.index(program.rank))


class Context(RuntimeStrategy):
    """Sequence chunks over runs of c ranks on the data axis (the Program's context part)."""

    name = StrategyName.CONTEXT
    axis = MeshAxis.CONTEXT

    def attach(self, ctx: DistContext, program: Program, specs: Specs, modules: Modules) -> None:
        shard = program.part(ContextShard.key)
        if shard is None:
            return
        rank = ContextRank(ctx.comm.group(shard.ranks), _layout(program, shard))
        for module in modules.values():
            setattr(module, CONTEXT, rank)

    def batches(self, program: Program, source: Any) -> Any:
        shard = program.part(ContextShard.key)
        if shard is None:
            return source
        return ContextBatches(source, _layout(program, shard), shard.dim)


__all__ = ["Context", "ContextBatches", "ContextRank"]
