"""The path at which builds written before strategies had their own homes import spatial parallelism's
tile operations (SpatialContext, ...).

Their rank scripts say `from runtime.spatial import ...`; new builds import from
`runtime.parallel.spatial.tiles`. Every name is looked up there on use, so both kinds of build run
the same code.
"""

from __future__ import annotations

import importlib

HOME = "runtime.parallel.spatial.tiles"


def __getattr__(name: str):
    return getattr(importlib.import_module(HOME), name)
