"""The path at which builds written before strategies had their own homes import sub-graph
parallelism's regions (SubgraphContext, ...).

Their rank scripts say `from runtime.subgraph import ...`; new builds import from
`runtime.parallel.subgraph.regions`. Every name is looked up there on use, so both kinds of build
run the same code.
"""

from __future__ import annotations

import importlib

HOME = "runtime.parallel.subgraph.regions"


def __getattr__(name: str):
    return getattr(importlib.import_module(HOME), name)
