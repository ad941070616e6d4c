"""Training batches for one data-parallel rank.

A data factory is referenced like a model factory ("examples/models/gpt.py:example_batch")
and called as `fn(batch_size, seed, **kwargs) -> (inputs, targets)`, where inputs is a tuple
of forward()'s positional tensors or a dict of its keyword tensors (Hugging Face models take
{"input_ids": ...}), and every tensor has the batch's rows first: the global batch
of step s is `fn(global_batch_size, data_seed + s)`. A factory that also accepts
`start` and `stop` keywords is asked for this rank's rows only (a real dataset reads
just its slice); otherwise the global batch is built and sliced (fine for the
synthetic examples, which are cheap pure functions of the seed).

Data rank r of d takes rows [r G/d, (r+1) G/d) and cuts them into micro-batches of
`micro_batch_size` consecutive rows: the same chunks, in the same order, that the
single-process reference walks through.
"""

from __future__ import annotations

from enum import StrEnum
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

Batch = tuple[Any, torch.Tensor]   # (positional tuple or keyword dict of input tensors, targets)


class DataError(ValueError):
    """A data factory whose batches do not have the promised form."""


def _accepts_slice(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "start" in params and "stop" in params


def input_values(inputs: Any) -> list:
    """The input tensors of a batch, positional or keyword, in order."""
    return list(inputs.values()) if isinstance(inputs, dict) else list(inputs)


def map_inputs(inputs: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` applied to every input tensor, keeping the tuple or dict form."""
    if isinstance(inputs, dict):
        return {k: fn(v) for k, v in inputs.items()}
    return tuple(fn(x) for x in inputs)


def batch_to(batch: Batch, device: torch.device | str) -> Batch:
    """A micro-batch (inputs, targets) with every tensor on `device`, the rank's: data factories and
    datasets give CPU tensors, and a model on a GPU fed CPU token ids fails in its first embedding
    ("index is on cpu, different from other tensors on cuda:0"), as a loss fed CPU targets does."""
    inputs, targets = batch
    return map_inputs(inputs, lambda x: x.to(device, non_blocking=True)), targets.to(device, non_blocking=True)


def call_model(model: Callable, inputs: Any):
    """model(*inputs) for positional inputs, model(**inputs) for keyword inputs."""
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def pick_input(inputs: Any, index: int, key: str) -> torch.Tensor:
    """One input tensor of a batch: keyword `key` of a dict batch, else positional `index`."""
    if isinstance(inputs, dict):
        if key not in inputs:
            raise DataError(f"the data factory's batch has no input {key!r} (it has {sorted(inputs)}); return the "
                            "keyword inputs the model was captured with")
        return inputs[key]
    if not 0 <= index < len(inputs):
        raise DataError(f"the data factory's batch has {len(inputs)} positional input(s); the model reads input "
                        f"#{index}" + (f" ({key!r})" if key else "") + ": return every input forward() takes")
    return inputs[index]


def check_batch(batch: Any, rows: int, where: str) -> Batch:
    """`batch` as (tuple-or-dict inputs, targets) with `rows` rows everywhere; DataError naming `where` otherwise."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], (tuple, list, dict))
            and isinstance(batch[1], torch.Tensor)):
        raise DataError(f"{where} must return (inputs, targets): inputs a tuple of positional tensors or a dict "
                        f"of keyword tensors, targets a tensor; got {type(batch).__name__}")
    inputs = dict(batch[0]) if isinstance(batch[0], dict) else tuple(batch[0])
    targets = batch[1]
    values = input_values(inputs)
    for t in (*values, targets):
        if not isinstance(t, torch.Tensor) or t.shape[0] != rows:
            raise DataError(f"{where} returned a batch whose tensors do not all have {rows} rows "
                            f"(shapes {[tuple(x.shape) for x in (*values, targets) if isinstance(x, torch.Tensor)]})")
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
        return check_batch(self.fn(g, self.data_seed + step, **self.kwargs), g, self.name)

    def local_batch(self, step: int) -> Batch:
        lo, hi = self.rows
        if self._slices:
            return check_batch(self.fn(self.global_batch_size, self.data_seed + step, start=lo, stop=hi,
                                  **self.kwargs), hi - lo, self.name)
        inputs, targets = self.global_batch(step)
        return map_inputs(inputs, lambda x: x[lo:hi]), targets[lo:hi]

    def micro_batches(self, step: int) -> list[Batch]:
        inputs, targets = self.local_batch(step)
        mb = self.micro_batch_size
        n = targets.shape[0] // mb
        return [(map_inputs(inputs, lambda x, k=k: x[k * mb:(k + 1) * mb]), targets[k * mb:(k + 1) * mb])
                for k in range(n)]


class Split(StrEnum):
    """Which batches a source gives: the training steps', or the held-out evaluation batches."""

    TRAIN = "train"
    EVAL = "eval"


# Evaluation batch j of a batch factory is fn(global_batch_size, data_seed + EVAL_SEED_OFFSET + j):
# seeds no training step of fewer than a billion steps reaches, so the batches are held out.
EVAL_SEED_OFFSET = 10 ** 9
