"""Runtime: executes per-rank Programs over torch.distributed (NCCL, gloo) or MPI.
Depends on no other meshplan package: a generated rank script imports only `runtime`
and the user's model code.

    Program, Instr, Bucket          runtime.program   the instruction set
    Timeline, Event, Recorder       runtime.trace     measured / predicted timelines
    DistContext                     runtime.context   rank, world, one group per mesh axis
    Communicator, TorchCommunicator  runtime.comm; MpiCommunicator  runtime.comm_mpi
    Executor, StageRunner, GradSync runtime.executor / stage / grads
    TrainSpec, StageSpec, OptimizerSpec               runtime.spec / optim
    run_local, run_many             runtime.launcher
    verify_build                    runtime.verify (the check behind meshplan run --verify)
    reference_run                   runtime.reference the single-process reference

Names are imported on first use, so `import runtime` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Program": "runtime.program", "Instr": "runtime.program", "Bucket": "runtime.program",
    "ProgramError": "runtime.program",
    "Timeline": "runtime.trace", "Event": "runtime.trace", "Recorder": "runtime.trace",
    "DistContext": "runtime.context",
    "Communicator": "runtime.comm", "TorchCommunicator": "runtime.comm", "MpiCommunicator": "runtime.comm_mpi",
    "CommError": "runtime.comm", "PeerFailure": "runtime.comm",
    "Executor": "runtime.executor", "RankFailure": "runtime.executor",
    "StageRunner": "runtime.stage", "GradSync": "runtime.grads",
    "TrainSpec": "runtime.spec", "StageSpec": "runtime.spec", "Boundary": "runtime.spec",
    "OptimizerSpec": "runtime.optim",
    "FeatureSplit": "runtime.tensor_parallel", "ModuleShard": "runtime.tensor_parallel",
    "run_local": "runtime.launcher", "run_many": "runtime.launcher", "verify_build": "runtime.verify",
    "reference_run": "runtime.reference",
    "load_ref": "runtime.refs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
