"""A batch factory for tests of the non-finite loss check: examples/models/mlp.py's batches,
with NaN inputs in the batch of one seed (step s reads seed data_seed + s)."""

import math

from examples.models.mlp import example_batch


def batch_with_nan(batch_size: int, seed: int, nan_seed: int = -1):
    (x,), targets = example_batch(batch_size, seed)
    if seed == nan_seed:
        x = x.clone()
        x[0, 0] = math.nan
    return (x,), targets
