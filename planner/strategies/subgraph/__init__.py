"""Sub-graph parallelism (SUPER), planner side, in one home: `strategy` (its Strategy: candidates,
validity, layer cost) and `regions` (which fork/join regions are split, and which sub-grid runs
each path).

The package itself imports nothing: planner.plan reads `regions` without loading the strategy."""
