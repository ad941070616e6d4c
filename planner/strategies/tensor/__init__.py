"""Tensor (and sequence) parallelism, planner side, in one home: `strategy` (its Strategy: the
sharding choice, layer cost, sequence-parallel pricing), `sharding` (tensor-parallel regions and
their shardings) and `split/` (the tensor-parallel split of every value, decided at plan time and
stored in the Plan).

The package itself imports nothing: planner.plan and codegen read `split` without loading the
strategy."""
