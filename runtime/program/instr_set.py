"""The names of the instruction set that a Program and its validation share: the ops (`Op`), the
message kinds (`Kind`), the derived axes, the Program file format version and ProgramError.

runtime/program/__init__.py (the types) and runtime/program/check.py (validation of a Program
document) both import them from here, so neither imports the other's module at call time.
"""

from __future__ import annotations

from enum import StrEnum

PROGRAM_FORMAT_VERSION = 1

PAIR_AXIS = "pair"   # derived axis: pipeline positions {i, p-1-i} x the data axis
TIE_AXIS = "tie:"    # derived axes "tie:I,J,...": pipeline positions I, J, ... (tied-weight copies)



class Op(StrEnum):
    """An instruction's operation. Like runtime.vocab's enums a member equals its text ("F" == Op.F), which
    is what Program files hold."""

    F = "F"                          # forward of one stage on one micro-batch
    B = "B"                          # its backward
    SEND = "SEND"                    # point-to-point, asynchronous (a handle)
    RECV = "RECV"
    ALLREDUCE = "ALLREDUCE"          # collectives on a mesh axis, asynchronous (a handle)
    ALLGATHER = "ALLGATHER"
    REDUCESCATTER = "REDUCESCATTER"
    BROADCAST = "BROADCAST"
    WAIT = "WAIT"                    # completes a handle
    STEP = "STEP"                    # the optimizer step (with the gradient guard: unscale, norm, clip, skip)
    ZERO_GRAD = "ZERO_GRAD"


class Kind(StrEnum):
    """What a communication instruction carries ("" for the instructions that carry nothing)."""

    NONE = ""
    ACT = "act"          # a stage's output activations (SEND/RECV)
    GRAD = "grad"        # the gradients of those activations (SEND/RECV)
    GRADS = "grads"      # a gradient bucket (ALLREDUCE, REDUCESCATTER)
    PARAMS = "params"    # a ZeRO-3 parameter bucket (ALLGATHER)
    LOSS = "loss"        # the step's loss (ALLREDUCE, BROADCAST)
    TIED = "tied"        # the gradients of tied weights over their copies (ALLREDUCE)
    STATS = "stats"      # a stage's running statistics (ALLREDUCE)


COMPUTE_OPS = (Op.F, Op.B)
P2P_OPS = (Op.SEND, Op.RECV)
COLLECTIVE_OPS = (Op.ALLREDUCE, Op.ALLGATHER, Op.REDUCESCATTER, Op.BROADCAST)
OPS = tuple(Op)
KINDS = tuple(Kind)
P2P_KINDS = (Kind.ACT, Kind.GRAD)


class ProgramError(ValueError):
    """A Program or instruction that is malformed; the message names the field."""
