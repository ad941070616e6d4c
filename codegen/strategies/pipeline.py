"""Pipeline parallelism in the lowering: where stages run, and the messages between them.

    placement  stage k runs on pipeline position k % pipeline; the position's forwards and
               backwards come in the plan's schedule's order (runtime/program/schedules.py)
    COMPUTE    receives posted one compute ahead and waited just before use; sends issued right
               after the compute that makes them, waited at the end of the pipeline (a send
               never blocks a rank mid-schedule, so the only waits are on data the schedule has
               already ordered: no deadlock)
    TIES       a weight used by several stages (tied embeddings) has a copy in each; once the
               gradient collectives are done, one all-reduce per tied weight over the pipeline
               positions holding a copy sums the copies' gradients
    STEP       the step's loss broadcast from the last stage to the other positions
"""

from __future__ import annotations

from typing import Callable, Iterator

from runtime.program.instr_set import Kind, Op
from runtime.program.schedules import ScheduleError, build_schedule
from codegen.strategies.base import Lowering, LoweringError, Pass, Phase, Params, Placement, RankPlan
from planner.plan import Plan
from runtime.program import Instr, Tie, rank_of, tie_axis
from runtime.vocab import MeshAxis, StrategyName


def p2p_pass(actions: list[Instr], handles: Iterator[int], peer_of: Callable[[int, int], int], num_stages: int,
             act_bytes: dict[int, int], grad_bytes: dict[int, int]) -> list[Instr]:
    """Insert SEND/RECV/WAIT around compute actions.

    A message is named by the cut it crosses: "act s m" is stage s's output for
    micro-batch m (sent to stage s + 1), "grad s m" its gradient (sent back from
    stage s + 1). Both ends of a message carry the same stage and micro-batch.
    act_bytes[s] / grad_bytes[s]: bytes of stage s's output activations / of their
    gradients (0: nothing crosses). peer_of(s, m): global rank running stage s for
    micro-batch m (same data and tensor coordinates; the micro-batch matters only for the
    bidirectional schedule, whose two directions place a stage on different ranks).
    """
    def recv_for(a: Instr) -> Instr | None:
        if a.op == Op.F and a.stage > 0 and act_bytes.get(a.stage - 1, 0):
            return Instr(Op.RECV, a.stage - 1, a.micro, peer=peer_of(a.stage - 1, a.micro), kind=Kind.ACT,
                         handle=next(handles), nbytes=act_bytes[a.stage - 1])
        if a.op == Op.B and a.stage < num_stages - 1 and grad_bytes.get(a.stage, 0):
            return Instr(Op.RECV, a.stage, a.micro, peer=peer_of(a.stage + 1, a.micro), kind=Kind.GRAD,
                         handle=next(handles), nbytes=grad_bytes[a.stage])
        return None

    recvs = [recv_for(a) if a.op in (Op.F, Op.B) else None for a in actions]
    out: list[Instr] = []
    sends: list[int] = []
    if recvs and recvs[0] is not None:
        out.append(recvs[0])
    for k, a in enumerate(actions):
        if k + 1 < len(actions) and recvs[k + 1] is not None:
            out.append(recvs[k + 1])          # pre-posted: overlaps with this compute
        if recvs[k] is not None:
            out.append(Instr(Op.WAIT, handle=recvs[k].handle))
        out.append(a)
        if a.op == Op.F and a.stage < num_stages - 1 and act_bytes.get(a.stage, 0):
            h = next(handles)
            out.append(Instr(Op.SEND, a.stage, a.micro, peer=peer_of(a.stage + 1, a.micro), kind=Kind.ACT, handle=h,
                             nbytes=act_bytes[a.stage]))
            sends.append(h)
        elif a.op == Op.B and a.stage > 0 and grad_bytes.get(a.stage - 1, 0):
            h = next(handles)
            out.append(Instr(Op.SEND, a.stage - 1, a.micro, peer=peer_of(a.stage - 1, a.micro), kind=Kind.GRAD, handle=h,
                             nbytes=grad_bytes[a.stage - 1]))
            sends.append(h)
    out += [Instr(Op.WAIT, handle=h) for h in sends]
    return out


def tie_pass(instrs: list[Instr], handles: Iterator[int], ties: tuple[Tie, ...], nbytes: dict[int, int]) -> list[Instr]:
    """One ALLREDUCE tied per tied weight this rank holds, and its WAIT, after every other
    instruction of the step body (the gradient collectives' WAITs included): the copies'
    gradients are complete there, and the step that follows reads their sum."""
    out = list(instrs)
    for tie in ties:
        h = next(handles)
        out += [Instr(Op.ALLREDUCE, kind=Kind.TIED, axis=tie.axis, handle=h, bucket=tie.index, nbytes=nbytes[tie.index]),
                Instr(Op.WAIT, handle=h)]
    return out


class Pipeline(Placement):
    """One-directional pipeline parallelism (GPipe, 1F1B, interleaved); with pipeline 1, the
    placement of a plan that cuts no stages."""

    name = StrategyName.PIPELINE

    def active(self, plan: Plan) -> bool:
        return True   # every plan is placed; a later placement (GEMS) refines it (registry.active)

    def schedule(self, lw: Lowering) -> dict[int, list[Instr]]:
        cfg = lw.plan.config
        try:
            return build_schedule(cfg.schedule, cfg.pipeline, lw.num_micro_batches, cfg.virtual_stages)
        except ScheduleError as e:
            raise LoweringError(str(e)) from None

    def positions(self, lw: Lowering, stage: int) -> list[int]:
        return [stage % lw.plan.config.pipeline]

    def peer_position(self, lw: Lowering, stage: int, micro: int) -> int:
        """The pipeline position that runs `stage` for micro-batch `micro`."""
        return stage % lw.plan.config.pipeline

    def place(self, lw: Lowering, rp: RankPlan) -> RankPlan:
        """`rp` with its stages and its gradient group: the stages at its position, reduced over data."""
        p = lw.plan.config.pipeline
        return rp.replace(stages=tuple(s for s in range(lw.num_stages) if s % p == rp.position),
                          grad_axis=MeshAxis.DATA, grad_group=lw.plan.config.data, grad_order=None)

    def loss_instr(self, lw: Lowering, rp: RankPlan, handle: int) -> Instr:
        """The step's last collective: the loss from the last stage's rank to the whole pipeline."""
        last = rank_of(lw.mesh, ((lw.num_stages - 1) % lw.plan.config.pipeline, *rp.coords[1:]))
        return Instr(Op.BROADCAST, kind=Kind.LOSS, axis=MeshAxis.PIPELINE, peer=last, handle=handle, nbytes=8)

    def plan_rank(self, lw: Lowering, rp: RankPlan, held: Callable[[int], Params]) -> RankPlan:
        rp = self.place(lw, rp)
        ties = []
        for k, (key, copies) in enumerate(lw.tied.items()):
            here = [(s, name) for s, name, _b in copies if s in rp.stages]
            if not here:
                continue
            holders = sorted({q for s, _n, _b in copies for q in self.positions(lw, s)})
            owned = tuple(s for s, _n in here if min(self.positions(lw, s)) == rp.position)
            ties.append(Tie(k, key, tuple(here), owned, tie_axis(holders)))
        return rp.replace(ties=tuple(ties))

    def passes(self, lw: Lowering, rp: RankPlan) -> list[tuple[Phase, Pass]]:
        def peer_of(stage: int, micro: int) -> int:
            return rank_of(lw.mesh, (self.peer_position(lw, stage, micro), *rp.coords[1:]))

        def loss(instrs: list[Instr], handles: Iterator[int]) -> list[Instr]:
            h = next(handles)
            return [*instrs, self.loss_instr(lw, rp, h), Instr(Op.WAIT, handle=h)]

        tie_bytes = {k: copies[0][2] for k, copies in enumerate(lw.tied.values())}
        out: list[tuple[Phase, Pass]] = [
            (Phase.COMPUTE, lambda ins, h: p2p_pass(ins, h, peer_of, lw.num_stages, lw.act_bytes, lw.grad_bytes)),
            (Phase.TIES, lambda ins, h: tie_pass(ins, h, rp.ties, tie_bytes))]
        if lw.plan.config.pipeline > 1:
            out.append((Phase.STEP, loss))
        return out


__all__ = ["Pipeline", "p2p_pass", "tie_pass"]
