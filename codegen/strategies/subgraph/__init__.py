"""Sub-graph parallelism (SUPER) in the lowering, in one home: `strategy` (the LoweringStrategy) and
`regions` (the region and path methods written into the generated stage code).

The package itself imports nothing, so importing one of its modules loads only what that needs."""
