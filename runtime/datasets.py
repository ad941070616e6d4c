"""Training batches from a torch Dataset named by reference (`meshplan codegen --dataset REF`).

A build may name a dataset instead of a batch factory: `DatasetSpec.ref` ("file.py:NAME") is a
`torch.utils.data.Dataset` class or a function returning one, built with `kwargs` on every rank
that reads data. A sample is `(inputs, target)`: inputs a tensor, a tuple of tensors (forward()'s
positional inputs) or a dict of tensors (its keyword inputs); target a tensor (or a number).
Micro-batches are collated by `collate_ref` (called as `fn(samples, **collate_kwargs)`) or by
torch's default_collate, and normalised to runtime.data's Batch form.

Sampling, map-style dataset of N samples (N counts the training samples: a held-out tail of
floor(N_all * holdout) samples is removed first). G is the global batch size, d the data ranks.

  * Epoch e is a permutation of range(N) drawn by torch.randperm from a torch.Generator seeded
    with data_seed + e (the identity with shuffle off).
  * Global batch s is the next G indices of the epoch stream. last_batch DROP: N // G steps per
    epoch, the partial tail of every epoch is skipped. PAD: ceil(N / G) steps per epoch; the last
    one is filled with the first indices of that epoch's permutation (index k of epoch e is
    perm_e[k mod N]).
  * Data rank r reads only rows [r G/d, (r+1) G/d) of each global batch (it never fetches the other
    rows' samples) and cuts them into micro-batches of micro_batch_size consecutive rows, as
    runtime.data.DataSource slices a factory's batch; so the single-process reference (d = 1)
    walks the same micro-batches in the same order, whatever the plan.
  * Step s -> (epoch, position) is arithmetic (`epoch_of`, `EpochOrder.position`): a run resumed
    from the checkpoint of step s reads exactly the samples the uninterrupted run would, from the
    next sample on, with no state saved for the data.

IterableDataset: we do not shuffle (the dataset may, in set_epoch). Every rank iterates the
stream, groups it into global batches of G samples and keeps its own rows; when the stream ends
the next epoch starts (set_epoch(e) is called first when the dataset has it), so epochs are
concatenated and a global batch may span two (last_batch does not apply: nothing is dropped).
Resuming at step s reads and discards the first s*G samples: O(position) work. Iterables are
read in the rank process (workers 0): each DataLoader worker would read the whole stream again.

Evaluation (Split.EVAL): the held-out tail (holdout > 0) or the dataset built with eval_kwargs
instead of kwargs. Evaluation batch j is rows [jG, (j+1)G) of it in order, wrapping around when
it is shorter, sliced per data rank like a training batch.
"""

from __future__ import annotations

from enum import StrEnum
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate

from runtime.data import Batch, DataError, Split, check_batch
from runtime.refs import call_factory, describe_failure, load_callable


class LastBatch(StrEnum):
    """What the partial last global batch of an epoch becomes."""

    DROP = "drop"   # skipped: N // G steps per epoch
    PAD = "pad"     # filled with the epoch's first indices: ceil(N / G) steps per epoch


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset named by reference, and how it is sampled (see the module docstring).

    Attributes:
        ref / kwargs: "file.py:NAME" of a Dataset class or a function returning one, its arguments.
        collate_ref / collate_kwargs: collate function fn(samples, **kw) -> (inputs, targets), or
            None for torch's default_collate.
        shuffle: permute every epoch (map-style only).
        last_batch: LastBatch.DROP or PAD.
        holdout: fraction of the samples (the tail) kept out of training for evaluation, in [0, 1).
        eval_kwargs: arguments for a separate evaluation dataset (e.g. {"split": "val"}), or None.
        workers: DataLoader worker processes (0: read in the rank process).
    """

    ref: str
    kwargs: dict = field(default_factory=dict)
    collate_ref: str | None = None
    collate_kwargs: dict = field(default_factory=dict)
    shuffle: bool = True
    last_batch: LastBatch = LastBatch.DROP
    holdout: float = 0.0
    eval_kwargs: dict | None = None
    workers: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.ref, str) or ":" not in self.ref:
            raise DataError(f"dataset reference {self.ref!r} has no ':NAME' part; write it like "
                            "'examples/data/tokens.py:TokenFile'")
        for name in ("kwargs", "collate_kwargs") + (("eval_kwargs",) if self.eval_kwargs is not None else ()):
            if not isinstance(getattr(self, name), dict):
                raise DataError(f"dataset {name} must be a dict of keyword arguments, got {getattr(self, name)!r}")
        if not (self.collate_ref is None or isinstance(self.collate_ref, str)):
            raise DataError(f"dataset collate_ref must be a reference 'file.py:NAME' or None, got {self.collate_ref!r}")
        if not isinstance(self.shuffle, bool):
            raise DataError(f"dataset shuffle must be true or false, got {self.shuffle!r}")
        if not isinstance(self.last_batch, LastBatch):
            raise DataError(f"dataset last_batch {self.last_batch!r} is not one of "
                            f"{[m.value for m in LastBatch]}")
        if not (isinstance(self.holdout, (int, float)) and 0 <= self.holdout < 1):
            raise DataError(f"dataset holdout {self.holdout!r} must be a fraction in [0, 1)")
        if self.holdout > 0 and self.eval_kwargs is not None:
            raise DataError("give the dataset a holdout fraction or eval_kwargs for a separate evaluation "
                            "dataset, not both")
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 0:
            raise DataError(f"dataset workers {self.workers!r} must be a whole number >= 0")

    def to_dict(self) -> dict:
        return {"ref": self.ref, "kwargs": dict(self.kwargs), "collate_ref": self.collate_ref,
                "collate_kwargs": dict(self.collate_kwargs), "shuffle": self.shuffle,
                "last_batch": self.last_batch.value, "holdout": self.holdout,
                "eval_kwargs": None if self.eval_kwargs is None else dict(self.eval_kwargs),
                "workers": self.workers}

    @classmethod
    def from_dict(cls, d: dict) -> "DatasetSpec":
        known = {"ref", "kwargs", "collate_ref", "collate_kwargs", "shuffle", "last_batch", "holdout",
                 "eval_kwargs", "workers"}
        if not isinstance(d, dict) or "ref" not in d or set(d) - known:
            raise DataError(f"build field 'dataset' must be a dict with 'ref' and some of {sorted(known)}; "
                            f"got {d!r}")
        d = dict(d)
        try:
            d["last_batch"] = LastBatch(d.get("last_batch", LastBatch.DROP.value))
        except ValueError:
            raise DataError(f"dataset last_batch {d['last_batch']!r} is not one of "
                            f"{[m.value for m in LastBatch]}") from None
        return cls(**d)


# --------------------------------------------------------------------------- orders of indices

@dataclass(frozen=True)
class EpochOrder:
    """Training order of a map-style dataset's indices [base, base + num_samples), by step."""

    num_samples: int
    global_batch_size: int
    seed: int
    shuffle: bool = True
    last_batch: LastBatch = LastBatch.DROP
    base: int = 0

    @property
    def steps_per_epoch(self) -> int:
        n, g = self.num_samples, self.global_batch_size
        return n // g if self.last_batch is LastBatch.DROP else -(-n // g)

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, index of the step's first sample within the epoch's permutation)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        return epoch, k * self.global_batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s order of range(num_samples): (num_samples,) int64."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))

    def indices(self, step: int, lo: int, hi: int, perm: torch.Tensor) -> list[int]:
        """Dataset indices of rows [lo, hi) of global batch `step`; `perm` is its epoch's permutation."""
        _, first = self.position(step)
        ks = (torch.arange(first + lo, first + hi) % self.num_samples)
        return (perm[ks] + self.base).tolist()


@dataclass(frozen=True)
class WrapOrder:
    """Evaluation order: batch j is indices base + [jG, (j+1)G) mod num_samples, unshuffled."""

    num_samples: int
    global_batch_size: int
    base: int = 0

    def indices(self, step: int, lo: int, hi: int, perm: torch.Tensor | None = None) -> list[int]:
        first = step * self.global_batch_size
        return [self.base + (first + k) % self.num_samples for k in range(lo, hi)]


class RankSampler(Sampler[int]):
    """Indices of rows [lo, hi) of every global batch, from `start_step` on (an endless stream:
    the DataLoader cuts it into micro-batches; the source takes as many as a step has)."""

    def __init__(self, order: EpochOrder | WrapOrder, lo: int, hi: int, start_step: int) -> None:
        self.order, self.lo, self.hi, self.start_step = order, lo, hi, start_step

    def __iter__(self) -> Iterator[int]:
        epoch, perm = None, None
        for step in itertools.count(self.start_step):
            if isinstance(self.order, EpochOrder):
                e, _ = self.order.position(step)
                if e != epoch:  # one permutation per epoch, drawn when the stream reaches it
                    epoch, perm = e, self.order.permutation(e)
            yield from self.order.indices(step, self.lo, self.hi, perm)


class RankStream(IterableDataset):
    """This data rank's samples of an IterableDataset: rows [lo, hi) of every group of G samples
    of the stream, from global batch `start_step` on (the first start_step * G samples are read
    and discarded). `epochs`: at the stream's end call set_epoch(e + 1) (when the dataset has it)
    and read it again; evaluation passes False (the same pass again, from the start)."""

    def __init__(self, dataset: IterableDataset, global_batch_size: int, lo: int, hi: int, start_step: int,
                 name: str, epochs: bool = True) -> None:
        self.dataset, self.g, self.lo, self.hi, self.start_step = dataset, global_batch_size, lo, hi, start_step
        self.name, self.epochs = name, epochs
        self.epoch_at: dict[int, int] = {}   # global batch -> epoch of its first sample (seen so far)

    def __iter__(self) -> Iterator[Any]:
        skip = self.start_step * self.g
        pos = 0
        for epoch in itertools.count():
            if self.epochs and hasattr(self.dataset, "set_epoch"):
                self.dataset.set_epoch(epoch)
            empty = True
            for sample in self.dataset:
                empty = False
                if pos >= skip:
                    step, row = divmod(pos, self.g)
                    if row == 0:
                        self.epoch_at[step] = epoch
                    if self.lo <= row < self.hi:
                        yield sample
                pos += 1
            if empty:
                raise DataError(f"{self.name} yielded no samples in epoch {epoch}; an IterableDataset must "
                                "yield at least one sample per pass")


# --------------------------------------------------------------------------- samples -> Batch

def check_sample(sample: Any, name: str) -> None:
    """DataError unless `sample` is (inputs, target): inputs a tensor, tuple or dict."""
    ok = (isinstance(sample, (tuple, list)) and len(sample) == 2
          and isinstance(sample[0], (torch.Tensor, tuple, list, dict)))
    if not ok:
        what = type(sample).__name__ + (f" of {len(sample)}" if isinstance(sample, (tuple, list)) else "")
        raise DataError(f"{name} returned a sample of type {what}; a sample must be (inputs, target) with inputs "
                        "a tensor, a tuple of tensors or a dict of tensors")


def normalise(batch: Any, rows: int, name: str) -> Batch:
    """A collated micro-batch in runtime.data's Batch form: tensor inputs become a 1-tuple."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        batch = ((batch[0],), batch[1])
    return check_batch(batch, rows, name)


class Collate:
    """The DataLoader's collate_fn: `fn` (or default_collate after checking each sample), normalised.
    A class, not a closure, so that DataLoader workers can receive it."""

    def __init__(self, fn: Callable | None, name: str) -> None:
        self.fn, self.name = fn, name

    def __call__(self, samples: list) -> Batch:
        if self.fn is None:
            for s in samples:
                check_sample(s, self.name)
            return normalise(default_collate(samples), len(samples), self.name)
        return normalise(self.fn(samples), len(samples), f"collate function of {self.name}")


# --------------------------------------------------------------------------- the source

def build_dataset(spec: DatasetSpec, root: str = "", kwargs: dict | None = None) -> Dataset:
    """The dataset `spec.ref` names, built with `kwargs` (default spec.kwargs); DataError when it is
    not a Dataset (a map-style one needs __len__ and __getitem__)."""
    fn = load_callable(spec.ref, root or None, "dataset")
    ds = call_factory(fn, spec.kwargs if kwargs is None else kwargs, ref=spec.ref, what="dataset")
    if isinstance(ds, IterableDataset):
        return ds
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        raise DataError(f"dataset {spec.ref} returned a {type(ds).__name__}, not a torch Dataset (a map-style "
                        "dataset needs __len__ and __getitem__; a stream subclasses IterableDataset)")
    return ds


def load_collate(spec: DatasetSpec, root: str = "") -> Callable | None:
    if spec.collate_ref is None:
        return None
    fn = load_callable(spec.collate_ref, root or None, "collate function")
    return functools.partial(fn, **spec.collate_kwargs) if spec.collate_kwargs else fn


def split_sizes(spec: DatasetSpec, total: int) -> tuple[int, int]:
    """(training samples, held-out samples) of a map-style dataset of `total` samples."""
    held = math.floor(total * spec.holdout)
    if spec.holdout > 0 and not 0 < held < total:
        raise DataError(f"holdout {spec.holdout} of dataset {spec.ref}'s {total} samples holds out {held}; "
                        "choose a fraction that keeps at least one sample on each side")
    return total - held, held


class DatasetSource:
    """One data rank's micro-batches of a dataset, by step (the interface of runtime.data.DataSource).

    Reading steps in order reuses one DataLoader iterator; any other step starts a new one there
    (a resumed run, or a reference that starts again)."""

    def __init__(self, spec: DatasetSpec, dataset: Dataset, collate: Callable | None, order: EpochOrder | WrapOrder | None,
                 global_batch_size: int, micro_batch_size: int, data_rank: int = 0, data_size: int = 1,
                 seed: int = 0, epochs: bool = True) -> None:
        if global_batch_size % (micro_batch_size * data_size):
            raise DataError(f"global batch {global_batch_size} does not split into micro-batches of "
                            f"{micro_batch_size} on {data_size} data ranks")
        self.spec, self.dataset, self.collate, self.order = spec, dataset, collate, order
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.data_rank, self.data_size, self.seed, self.epochs = data_rank, data_size, seed, epochs
        self.name = f"dataset {spec.ref}"
        self._iter: Iterator | None = None
        self._stream: RankStream | None = None
        self._next_step = -1
        self._whole: DatasetSource | None = None

    @property
    def rows(self) -> tuple[int, int]:
        per = self.global_batch_size // self.data_size
        return self.data_rank * per, (self.data_rank + 1) * per

    def epoch_of(self, step: int) -> int | None:
        """The epoch global batch `step` starts in (map-style: arithmetic; a stream: the epoch seen
        while reading it, None before it was read). Evaluation batches: 0."""
        if isinstance(self.order, EpochOrder):
            return self.order.position(step)[0]
        if isinstance(self.order, WrapOrder):
            return 0
        return self._stream.epoch_at.get(step) if self._stream is not None else None

    def _loader(self, start_step: int) -> DataLoader:
        lo, hi = self.rows
        common = dict(batch_size=self.micro_batch_size, collate_fn=Collate(self.collate, self.name),
                      # DataLoader draws its workers' base seed from this generator, not the global RNG
                      # (which the model's dropout uses and must see the same draws as the reference).
                      generator=torch.Generator().manual_seed(self.seed))
        if self.order is None:
            self._stream = RankStream(self.dataset, self.global_batch_size, lo, hi, start_step, self.name, self.epochs)
            return DataLoader(self._stream, num_workers=0, **common)
        return DataLoader(self.dataset, sampler=RankSampler(self.order, lo, hi, start_step),
                          num_workers=self.spec.workers, **common)

    def micro_batches(self, step: int) -> list[Batch]:
        if self._iter is None or step != self._next_step:
            self._iter = iter(self._loader(step))
        n = (self.global_batch_size // self.data_size) // self.micro_batch_size
        try:
            out = [next(self._iter) for _ in range(n)]
        except DataError:
            self._iter = None
            raise
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the dataset's code may raise anything: name it
            self._iter = None
            raise DataError(f"{self.name} {describe_failure(e)} while reading step {step}; fix the dataset or "
                            "its --dataset-arg values") from None
        self._next_step = step + 1
        return out

    def global_batch(self, step: int) -> Batch:
        """All G rows of global batch `step` (as data rank 0 of 1 reads them)."""
        if self._whole is None:
            self._whole = DatasetSource(self.spec, self.dataset, self.collate, self.order, self.global_batch_size,
                                        self.global_batch_size, 0, 1, self.seed, self.epochs)
        return self._whole.micro_batches(step)[0]


def open_dataset(spec: DatasetSpec, global_batch_size: int, micro_batch_size: int, data_rank: int = 0,
                 data_size: int = 1, data_seed: int = 1000, split: Split = Split.TRAIN,
                 root: str = "") -> DatasetSource:
    """This data rank's source of `split` batches of the dataset `spec` names (module docstring)."""
    collate = load_collate(spec, root)
    if split is Split.EVAL and spec.eval_kwargs is None and spec.holdout == 0:
        raise DataError(f"dataset {spec.ref} has no evaluation split: give codegen --holdout F (the dataset's "
                        "tail) or --eval-dataset-arg KEY=VALUE (a separate evaluation dataset)")
    use_eval_dataset = split is Split.EVAL and spec.eval_kwargs is not None
    ds = build_dataset(spec, root, spec.eval_kwargs if use_eval_dataset else None)
    args = (global_batch_size, micro_batch_size, data_rank, data_size, data_seed)
    if isinstance(ds, IterableDataset):
        if spec.workers:
            raise DataError(f"dataset {spec.ref} is an IterableDataset, read in the rank process: give "
                            "--data-workers 0 (each worker would read the whole stream again)")
        if spec.holdout > 0:
            raise DataError(f"dataset {spec.ref} is an IterableDataset, which has no tail to hold out: give "
                            "--eval-dataset-arg KEY=VALUE for a separate evaluation stream instead of --holdout")
        if spec.last_batch is LastBatch.PAD:
            raise DataError(f"dataset {spec.ref} is an IterableDataset, whose epochs are read back to back "
                            "(nothing is dropped or padded): leave --last-batch at drop")
        return DatasetSource(spec, ds, collate, None, *args, epochs=split is Split.TRAIN)
    total = len(ds)
    if use_eval_dataset:
        if total < 1:
            raise DataError(f"evaluation dataset {spec.ref} with {spec.eval_kwargs} has no samples")
        return DatasetSource(spec, ds, collate, WrapOrder(total, global_batch_size), *args)
    n_train, n_held = split_sizes(spec, total)
    if split is Split.EVAL:
        return DatasetSource(spec, ds, collate, WrapOrder(n_held, global_batch_size, base=n_train), *args)
    if n_train < (global_batch_size if spec.last_batch is LastBatch.DROP else 1):
        raise DataError(f"dataset {spec.ref} has {n_train} training samples, fewer than the global batch of "
                        f"{global_batch_size}: use --last-batch pad, a smaller --batch or a larger dataset")
    order = EpochOrder(n_train, global_batch_size, data_seed, spec.shuffle, spec.last_batch)
    return DatasetSource(spec, ds, collate, order, *args)
