"""Tied weights across stages: the copies' gradients summed before every optimizer step.

A weight the model uses in two places (GPT-2's token embedding and its output layer)
lands in two pipeline stages when the plan cuts between its users. Every stage that uses
it holds a copy (runtime.materialize builds them from the same weight, so they start
equal). After the step's gradient collectives (over data, or over the GEMS pair), each
copy's gradient is that stage's whole contribution; `TieSync` replaces it by the sum over
all copies: the copies on this rank that it owns (Program.ties) are added up, the sum is
all-reduced over the ranks holding copies (Megatron's embedding group), and written back
into every copy here. Equal gradients, equal optimizer state: the copies stay bit-equal.

Under ZeRO a copy is alone in its gradient bucket (codegen.strategies.data.make_buckets), so its
reduce-scattered shard is the same slice of the weight on every copy: the shards are summed.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from runtime.comm import DoneHandle, Group, Handle
from runtime.program import Tie


class _WriteBack:
    """Waits for the all-reduce of the sum, then copies the sum into every copy's gradient."""

    def __init__(self, handle: Handle, total: torch.Tensor, views: list[torch.Tensor]):
        self._handle, self._total, self._views = handle, total, views

    def wait(self) -> None:
        self._handle.wait()
        for v in self._views:
            v.copy_(self._total)

    def on_complete(self, fn: Callable[[], None]) -> None:
        self._handle.on_complete(fn)


class TieSync:
    """The tied weights of one rank.

    Args:
        ties: the Program's ties (this rank's copies).
        modules: stage index -> stage module.
        groups: axis name -> Group, for each tie's axis.
        grads: the rank's GradSync, or None (no data axis: gradients live in `.grad`).
    """

    def __init__(self, ties: tuple[Tie, ...], modules: dict[int, nn.Module], groups: dict[str, Group], grads=None):
        self._ties = {t.index: t for t in ties}
        self._groups = groups
        self._copies: dict[int, list[tuple[int, nn.Parameter]]] = {}
        for t in ties:
            copies = []
            for stage, name in t.copies:
                named = dict(modules[stage].named_parameters(remove_duplicate=False))
                if name not in named:
                    raise ValueError(f"tied weight {t.name}: stage {stage}'s module has no parameter {name!r}; "
                                     "generate the build again")
                copies.append((stage, named[name]))
            self._copies[t.index] = copies
        self._grads = grads
        self.skip_sum = False   # testing (--sabotage skip-tied-sum): leave each copy with its own gradient

    def _gradient(self, p: nn.Parameter) -> torch.Tensor:
        """Where this rank's reduced gradient of copy `p` lives: its ZeRO shard, or .grad."""
        if self._grads is not None and self._grads.shards:
            return self._grads.shard_grad_of(p)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def launch(self, index: int) -> Handle:
        """Start summing tied weight `index`'s gradients; the handle's wait() completes it."""
        tie = self._ties[index]
        views = [self._gradient(p) for _s, p in self._copies[index]]
        if self.skip_sum:
            return DoneHandle()
        total = torch.zeros_like(views[0])
        for (stage, _p), v in zip(self._copies[index], views):
            if stage in tie.owned:
                total += v
        group = self._groups[tie.axis]
        if group.size == 1:
            for v in views:
                v.copy_(total)
            return DoneHandle()
        return _WriteBack(group.all_reduce(total, async_op=True), total, views)
