"""The path at which builds written before strategies had their own homes import the tensor-parallel
layers and collectives (scatter_to_group, ...).

Their rank scripts say `from runtime.tensor_parallel import ...`; new builds import from
`runtime.parallel.tensor.layers`. Every name is looked up there on use, so both kinds of build run
the same code.
"""

from runtime.lazy import forwarding

__getattr__ = forwarding("runtime.parallel.tensor.layers")
