"""The output layer's vocabulary under a tensor split (codegen/head.py finds the layer): which split
holds its rows, and that split padded so each rank's block of the vocabulary is a multiple of m."""

from __future__ import annotations

import dataclasses

from codegen.head import HeadSite
from planner.strategies.tensor.split.splits import TensorSplits
from runtime.program.shards import FeatureSplit


def output_rows_split(splits: TensorSplits, site: HeadSite) -> FeatureSplit | None:
    """The split of the output layer's rows (its weight's dimension 0) in `splits`, or None when the
    plan leaves the layer whole."""
    if site.module is not None:
        sh = next((m for m in splits.modules if m.path == site.module), None)
        return sh.split if sh is not None else None
    ps = next((p for p in splits.params if p.name == site.weight), None)
    return ps.split if ps is not None and ps.dim == 0 else None


def pad_splits(splits: TensorSplits, split: FeatureSplit, multiple: int) -> TensorSplits:
    """`splits` with every FeatureSplit equal to the vocabulary's `split` rounding each rank's block
    up to a multiple of `multiple` (the logits, the layer's rows, a tied embedding's rows: one split).
    Another plain split of the same size, if any, is padded alike, which computes the same: padding
    of a plain split holds zeros the model never reads (runtime/parallel/tensor/layers.py)."""
    padded = dataclasses.replace(split, multiple=multiple)

    def fix(fs: FeatureSplit) -> FeatureSplit:
        return padded if fs == split else fs

    return dataclasses.replace(
        splits,
        values=tuple((n, d, fix(fs)) for n, d, fs in splits.values),
        modules=tuple(dataclasses.replace(m, split=fix(m.split)) for m in splits.modules),
        params=tuple(dataclasses.replace(p, split=fix(p.split)) for p in splits.params),
        scatters=tuple((n, x, d, fix(fs)) for n, x, d, fs in splits.scatters),
        output=None if splits.output is None else fix(splits.output))
