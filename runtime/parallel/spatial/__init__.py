"""Spatial parallelism at run time, in one home: `strategy` (what it attaches to the stage modules),
`tiles` (the tile operations the generated stage code calls: halo exchanges, window ops, the
tiled BatchNorm) and `geometry` (tiles, halos and the SpatialSpec, with no tensors).

The package itself imports nothing: runtime.spec reads the geometry without loading the rest."""
