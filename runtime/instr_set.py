"""The names of the instruction set that a Program and its validation share: the ops, the
message kinds, the derived axes, the Program file format version and ProgramError.

runtime/program.py (the types) and runtime/program_check.py (validation of a Program
document) both import them from here, so neither imports the other's module at call time.
"""

from __future__ import annotations

PROGRAM_FORMAT_VERSION = 1

PAIR_AXIS = "pair"   # derived axis: pipeline positions {i, p-1-i} x the data axis
TIE_AXIS = "tie:"    # derived axes "tie:I,J,...": pipeline positions I, J, ... (tied-weight copies)

COMPUTE_OPS = ("F", "B")
P2P_OPS = ("SEND", "RECV")
COLLECTIVE_OPS = ("ALLREDUCE", "ALLGATHER", "REDUCESCATTER", "BROADCAST")
OPS = (*COMPUTE_OPS, *P2P_OPS, *COLLECTIVE_OPS, "WAIT", "STEP", "ZERO_GRAD")
KINDS = ("", "act", "grad", "grads", "params", "loss", "tied", "stats")


class ProgramError(ValueError):
    """A Program or instruction that is malformed; the message names the field."""
