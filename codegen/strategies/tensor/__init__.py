"""Tensor (and sequence) parallelism in the lowering, in one home: `split` (the Plan's split of
every value applied to the stage modules), `sequence` (the sequence-parallel stream between
tensor-parallel regions), `shapes` (local shapes in the generated code) and `weight_ops` (weights
used by ops other than their module's own).

Tensor parallelism changes no instruction of a Program: codegen/partition.py applies these while it writes
each stage. Its LoweringStrategy (`strategy`) gives the torch target the split modules' styles
(`torch_styles`). The package itself imports nothing."""
