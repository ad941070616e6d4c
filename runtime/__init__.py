"""Runtime: executes per-rank Programs over torch.distributed (NCCL, gloo) or MPI.
Depends on no other meshplan package: a generated rank script imports only `runtime`
and the user's model code.

What a user or a generated script needs is named here; everything else is reached by
its module path (runtime.comm.torch_dist.TorchCommunicator, runtime.spec.TrainSpec, ...):

    Program, Instr, ProgramError    runtime.program   the instruction set
    Timeline                        runtime.program.trace     measured / predicted timelines
    DistContext                     runtime.comm.context   rank, world, one group per mesh axis
    run_rank                        runtime.rank_main what each rank script calls
    run_local, BuildError           runtime.launch.launcher  run a build directory on this machine
    verify_build                    runtime.verify    the check behind meshplan run --verify
    reference_run                   runtime.reference the single-process reference

Names are imported on first use, so `import runtime` stays cheap.
"""

from __future__ import annotations

from runtime.lazy import forwarding

_EXPORTS = {
    "Program": "runtime.program", "Instr": "runtime.program", "ProgramError": "runtime.program",
    "Timeline": "runtime.program.trace",
    "DistContext": "runtime.comm.context",
    "run_rank": "runtime.rank_main",
    "run_local": "runtime.launch.launcher", "BuildError": "runtime.launch.launcher",
    "verify_build": "runtime.verify",
    "reference_run": "runtime.reference",
}

__all__ = sorted(_EXPORTS)


__getattr__ = forwarding(_EXPORTS, "runtime")
