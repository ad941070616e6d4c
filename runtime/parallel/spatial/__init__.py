"""Spatial parallelism at run time, in one home: `strategy` (what it attaches to the stage modules),
`tiles` (the SpatialContext the generated stage code calls, and how it gets this rank's tile),
`tile_ops` (what runs on a tile: window ops, the tiled BatchNorm, the gather), `halo` (the halo
exchange between neighbouring tiles) and `geometry` (tiles, halos and the SpatialSpec, with no tensors).

The package itself imports nothing: runtime.spec reads the geometry (a StageSpec part, through
runtime/parallel/parts.py) without loading the rest."""
