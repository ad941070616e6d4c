"""The runtime executor's own time per instruction, measured by running it (every rank at once).

Between two instructions the executor records the finished one and dispatches the
next; an asynchronous instruction (SEND, RECV, a collective) occupies its rank while
it is issued (building or allocating the message buffers, posting the transfer,
registering its completion). Neither is in any op's time, and on small models a step
has dozens of instructions of a few tens of microseconds each, so they matter.

`time_executor` runs a reference pipeline through runtime.executor.Executor, traced,
exactly as a generated rank runs its Program: one stage per rank in a chain of
`world` stages (a Linear + ReLU pair of REF_WIDTH features per stage, a classifier
head and cross-entropy on the last), in 1F1B order with the receives posted ahead, the
loss broadcast from the last stage and all-reduced. From the trace of the steps after
the first it takes, as medians:

- gap.<op>: seconds from the end of a synchronous instruction (F, B, WAIT, STEP,
  ZERO_GRAD) to the start of the next one;
- issue.<op>: seconds from the start of an asynchronous instruction (SEND, RECV,
  ALLREDUCE, BROADCAST) to the start of the next one on its rank;
- extra.F / extra.B: how much longer a forward / backward instruction takes in the run
  than the same stage called in a row (the executor's work inside the instruction:
  gathering its inputs, the loss read-back; and caches the other instructions cooled).

cost_models/simulate.py advances a rank's clock by these after each instruction.
"""

from __future__ import annotations

import statistics

import torch

from cost_models.calibration.stage import _median_calls, reference_runner, runner_calls
from runtime.comm.context import DistContext
from runtime.data import DataSource
from runtime.executor import Executor
from runtime.program.instr_set import Kind, Op
from runtime.program import Instr, Program
from runtime.program.schedules import one_f_one_b
from runtime.program.trace import Recorder
from runtime.vocab import MeshAxis, default_mesh_order

REF_WIDTH = 128            # features of the reference stages
REF_ROWS = 2               # samples per micro-batch
REF_CLASSES = 16
REF_MICRO_BATCHES = 4


def reference_programs(world: int, micro_batches: int = REF_MICRO_BATCHES) -> list:
    """The Programs of the reference pipeline, one per rank: rank r runs stage r of `world`.

    1F1B order with every receive posted at the start of the step, each waited right
    before the compute that needs it, sends waited at the end; then the loss broadcast from
    the last stage and all-reduced over the pipeline (both collectives a real step has),
    each waited; STEP and ZERO_GRAD as every step has them."""
    nbytes = REF_ROWS * REF_WIDTH * 4
    last = world - 1
    mesh = tuple(zip(default_mesh_order(), (world, 1, 1)))   # pipeline, data, tensor
    order = one_f_one_b(world, micro_batches)
    progs = []
    for r in range(world):
        ms = range(micro_batches)
        act = {m: m for m in ms} if r > 0 else {}
        grad = {m: len(act) + m for m in ms} if r < last else {}
        ins = [Instr(Op.ZERO_GRAD)]
        ins += [Instr(Op.RECV, kind=Kind.ACT, stage=r - 1, micro=m, peer=r - 1, handle=k, nbytes=nbytes)
                for m, k in act.items()]
        ins += [Instr(Op.RECV, kind=Kind.GRAD, stage=r, micro=m, peer=r + 1, handle=k, nbytes=nbytes)
                for m, k in grad.items()]
        h = len(act) + len(grad)
        sends = []
        for action in order[r]:
            op, m = action.op, action.micro
            wait, send = (act, r < last) if op == Op.F else (grad, r > 0)
            if m in wait:
                ins.append(Instr(Op.WAIT, handle=wait[m]))
            ins.append(Instr(op, stage=r, micro=m))
            if send:
                sends.append(h)
                ins.append(Instr(Op.SEND, kind=Kind.ACT, stage=r, micro=m, peer=r + 1, handle=h, nbytes=nbytes)
                           if op == Op.F else
                           Instr(Op.SEND, kind=Kind.GRAD, stage=r - 1, micro=m, peer=r - 1, handle=h, nbytes=nbytes))
                h += 1
        ins += [Instr(Op.WAIT, handle=k) for k in sends]
        ins.append(Instr(Op.STEP))
        for op in (Op.BROADCAST, Op.ALLREDUCE):
            ins += [Instr(op, kind=Kind.LOSS, axis=MeshAxis.PIPELINE, peer=last if op == Op.BROADCAST else -1, handle=h,
                          nbytes=8), Instr(Op.WAIT, handle=h)]
            h += 1
        progs.append(Program(rank=r, world_size=world, mesh=mesh, coords=(r, 0, 0), stages=(r,), num_stages=world,
                             num_micro_batches=micro_batches, micro_batch_size=REF_ROWS, instrs=tuple(ins)))
    return progs


def _runner(rank: int, world: int):
    is_last = rank == world - 1
    return reference_runner(rank, 1, REF_WIDTH, REF_ROWS, REF_CLASSES if is_last else None, is_last,
                            "recv" if rank > 0 else "data", 1.0 / REF_MICRO_BATCHES)


def _batch(global_batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(global_batch, REF_WIDTH, generator=g),), torch.randint(0, REF_CLASSES, (global_batch,),
                                                                               generator=g)


def time_executor(comm, *, steps: int = 12) -> dict[str, dict[str, float]]:
    """{"gap": {op: s}, "issue": {op: s}, "extra": {"F": s, "B": s}} of this rank, from `steps` traced
    steps of the reference pipeline over all of `comm`'s ranks (the first step is warm-up). Every
    rank must call it."""
    world, rank = comm.world_size, comm.rank
    program = reference_programs(world)[rank]
    ctx = DistContext.create(comm, program.mesh)
    data = DataSource(_batch, {}, REF_ROWS * REF_MICRO_BATCHES, REF_ROWS, name="reference batches") \
        if rank in (0, world - 1) else None
    recorder = Recorder(rank)
    ex = Executor(program, ctx, {rank: _runner(rank, world)}, None, None, data, recorder)
    comm.barrier()
    for step in range(steps):
        ex.run_step(step)
    timeline = recorder.timeline()
    out = trace_costs(timeline, program, skip_steps=1)
    comm.barrier()
    out["extra"] = _in_run_extra(timeline, ex.stages[rank], data)
    return out


def _in_run_extra(timeline, runner, data) -> dict[str, float]:
    """{"F": s, "B": s}: the traced forward / backward instructions' median less the same stage's
    forward / backward called in a row (as cost_models/calibration/stage times the stage call)."""
    traced = {op: statistics.median(e.duration for e in timeline.events if e.op == op and e.step >= 1)
              for op in (Op.F, Op.B)}
    x, y = data.micro_batches(0)[0] if data is not None else ((torch.randn(REF_ROWS, REF_WIDTH),), None)
    row = _median_calls(runner_calls(runner, x[0], y, torch.randn(REF_ROWS, REF_WIDTH)), 200)
    return {"F": max(traced["F"] - row[0], 0.0), "B": max(traced["B"] - row[1], 0.0)}


def trace_costs(timeline, program, *, skip_steps: int = 1) -> dict[str, dict[str, float]]:
    """{"gap": {op: s}, "issue": {op: s}}: medians over `timeline`'s steps from `skip_steps` on of
    one rank's time from a synchronous instruction's end (gap) or an asynchronous one's start
    (issue) to the start of the next instruction of the same step."""
    starts: dict[tuple[int, int], float] = {}
    ends: dict[tuple[int, int], float] = {}
    for e in timeline.events:
        if e.step >= skip_steps:
            starts[(e.step, e.index)] = e.start
            ends[(e.step, e.index)] = e.end
    gaps: dict[str, list[float]] = {}
    issues: dict[str, list[float]] = {}
    for (step, i), start in starts.items():
        nxt = starts.get((step, i + 1))
        if nxt is None:
            continue
        ins = program.instrs[i]
        if ins.is_async:
            issues.setdefault(ins.op, []).append(nxt - start)
        else:
            gaps.setdefault(ins.op, []).append(nxt - ends[(step, i)])
    return {"gap": {op: max(statistics.median(v), 0.0) for op, v in sorted(gaps.items())},
            "issue": {op: max(statistics.median(v), 0.0) for op, v in sorted(issues.items())}}
