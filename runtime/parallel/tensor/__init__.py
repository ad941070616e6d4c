"""Tensor (and sequence) parallelism at run time, in one home: `strategy` (the tensor group given to
the stage modules, sequence-parallel gradients) and `layers` (the tensor-parallel modules, feature
splits and the collectives between them).

The package itself imports nothing: runtime.spec and runtime.materialize read `layers` without
loading the strategy hook (which imports them)."""
