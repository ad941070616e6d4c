"""Training batches for one data-parallel rank.

A data factory is referenced like a model factory ("examples/models/gpt.py:example_batch")
and called as `fn(batch_size, seed, **kwargs) -> ((inputs...), targets)`: the global batch
of step s is `fn(global_batch_size, data_seed + s)`. A factory that also accepts
`start` and `stop` keywords is asked for this rank's rows only (a real dataset reads
just its slice); otherwise the global batch is built and sliced (fine for the
synthetic examples, which are cheap pure functions of the seed).

Data rank r of d takes rows [r G/d, (r+1) G/d) and cuts them into micro-batches of
`micro_batch_size` consecutive rows: the same chunks, in the same order, that the
single-process reference walks through.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


class DataError(ValueError):
    """A data factory whose batches do not have the promised form."""


def _accepts_slice(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "start" in params and "stop" in params


def _check(batch: Any, rows: int, where: str) -> Batch:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], (tuple, list))
            and isinstance(batch[1], torch.Tensor)):
        raise DataError(f"{where} must return ((inputs...), targets) with tensors, got {type(batch).__name__}")
    inputs, targets = tuple(batch[0]), batch[1]
    for t in (*inputs, targets):
        if not isinstance(t, torch.Tensor) or t.shape[0] != rows:
            raise DataError(f"{where} returned a batch whose tensors do not all have {rows} rows "
                            f"(shapes {[tuple(x.shape) for x in (*inputs, targets) if isinstance(x, torch.Tensor)]})")
    return inputs, targets


@dataclass
class DataSource:
    """This data rank's micro-batches of every step."""

    fn: Callable[..., Any]
    kwargs: dict
    global_batch_size: int
    micro_batch_size: int
    data_rank: int = 0
    data_size: int = 1
    data_seed: int = 1000
    name: str = "data factory"

    def __post_init__(self) -> None:
        self._slices = _accepts_slice(self.fn)
        if self.global_batch_size % (self.micro_batch_size * self.data_size):
            raise DataError(f"global batch {self.global_batch_size} does not split into micro-batches of "
                            f"{self.micro_batch_size} on {self.data_size} data ranks")

    @property
    def rows(self) -> tuple[int, int]:
        per = self.global_batch_size // self.data_size
        return self.data_rank * per, (self.data_rank + 1) * per

    def global_batch(self, step: int) -> Batch:
        g = self.global_batch_size
        return _check(self.fn(g, self.data_seed + step, **self.kwargs), g, self.name)

    def local_batch(self, step: int) -> Batch:
        lo, hi = self.rows
        if self._slices:
            return _check(self.fn(self.global_batch_size, self.data_seed + step, start=lo, stop=hi,
                                  **self.kwargs), hi - lo, self.name)
        inputs, targets = self.global_batch(step)
        return tuple(x[lo:hi] for x in inputs), targets[lo:hi]

    def micro_batches(self, step: int) -> list[Batch]:
        inputs, targets = self.local_batch(step)
        mb = self.micro_batch_size
        n = targets.shape[0] // mb
        return [(tuple(x[k * mb:(k + 1) * mb] for x in inputs), targets[k * mb:(k + 1) * mb]) for k in range(n)]
