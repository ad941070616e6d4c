"""The path at which builds written before strategies had their own homes import spatial parallelism's
tile operations (SpatialContext, ...).

Their rank scripts say `from runtime.spatial import ...`; new builds import from
`runtime.parallel.spatial.tiles`. Every name is looked up there on use, so both kinds of build run
the same code.
"""

from runtime.lazy import forwarding

__getattr__ = forwarding("runtime.parallel.spatial.tiles")
