"""The path at which builds written before strategies had their own homes import sub-graph
parallelism's regions (SubgraphContext, ...).

Their rank scripts say `from runtime.subgraph import ...`; new builds import from
`runtime.parallel.subgraph.regions`. Every name is looked up there on use, so both kinds of build
run the same code.
"""

from runtime.lazy import forwarding

__getattr__ = forwarding("runtime.parallel.subgraph.regions")
