"""Where one data rank's batches come from: a batch factory by reference (runtime.data.DataSource)
or a torch Dataset by reference (runtime.datasets.DatasetSource).

Kept out of runtime/data.py because it needs runtime/datasets.py, which builds on runtime/data.py:
in one module the two would import each other.
"""

from __future__ import annotations

from runtime.data import EVAL_SEED_OFFSET, DataSource, Split
from runtime.datasets import DatasetSource, open_dataset
from runtime.materialize import load_factory
from runtime.spec import TrainSpec


def open_data(spec: TrainSpec, micro_batch_size: int, data_rank: int = 0, data_size: int = 1,
              split: Split = Split.TRAIN) -> DataSource | DatasetSource:
    """This data rank's source of `split` batches for the build's training setup: a DataSource for a
    batch factory (data_ref), a runtime.datasets.DatasetSource for a dataset (spec.dataset); both
    answer micro_batches(step) and global_batch(step).

    The one place rank processes, the single-process reference and --verify get their batches from
    (data_size 1: the whole global batch, for the reference)."""
    if spec.dataset is not None:  # a torch Dataset by reference: runtime/datasets.py
        return open_dataset(spec.dataset, spec.global_batch_size, micro_batch_size, data_rank, data_size,
                            spec.data_seed, split, spec.root)
    seed = spec.data_seed + (EVAL_SEED_OFFSET if split is Split.EVAL else 0)
    return DataSource(load_factory(spec.data_ref, spec.root, "data factory"), dict(spec.data_kwargs),
                      spec.global_batch_size, micro_batch_size, data_rank, data_size, seed,
                      name=f"data factory {spec.data_ref}")
