"""Spatial parallelism in the lowering, in one home: `strategy` (the LoweringStrategy), `program`
(each rank's tile in its Program, the spatial stages) and `tiles` (the tile calls written into the
generated stage code).

The package itself imports nothing, so importing one of its modules loads only what that needs."""
