"""Spatial parallelism at run time, in one home: `strategy` (what it attaches to the stage modules),
`tiles` (the tile operations the generated stage code calls: halo exchanges, window ops, the
tiled BatchNorm) and `geometry` (tiles, halos and the SpatialSpec, with no tensors).

The package itself imports nothing: runtime.spec reads the geometry (a StageSpec part, through
runtime/parallel/parts.py) without loading the rest."""
