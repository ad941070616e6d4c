"""Sub-graph parallelism (SUPER) at run time, in one home: `strategy` (what it attaches to the
stage modules) and `regions` (a split fork/join region and the modules a sub-grid holds).

The package itself imports nothing, so importing one of its modules loads only what that needs."""
