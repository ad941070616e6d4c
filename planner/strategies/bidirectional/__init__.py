"""Bi-directional pipelines (GEMS/MASTER), planner side, in one home: `strategy` (its Strategy: the hooks the Evaluator and the
search call) and `fields` (its ParallelConfig fields: their checks, label, summary text and plan
checks). The package itself imports nothing: ParallelConfig reads `fields` without loading the
strategy, which imports ParallelConfig."""
