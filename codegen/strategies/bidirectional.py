"""Bidirectional pipelines (GEMS: MAST, and MASTER with replicas_per_direction > 1) in the lowering.

Two replicas of the model share the p pipeline positions in opposite directions: position i
holds stage i (replica A) and stage p-1-i (replica B), and a micro-batch's parity says which
direction, and so which position, runs a stage (runtime.program.schedules.bidirectional_position). Both
ranks of the pair {i, p-1-i} hold the same two stages and reduce their gradients over the pair
group (runtime.program.PAIR_AXIS: both positions across every data rank), higher stage first on
both so that their collectives match. The last stage runs on two positions, each with its
direction's share of the loss: an all-reduce over the pipeline sums them.
"""

from __future__ import annotations

from runtime.program.instr_set import Kind, Op
from runtime.program.schedules import ScheduleError, bidirectional, bidirectional_position
from codegen.strategies.base import Lowering, LoweringError, RankPlan
from codegen.strategies.pipeline import Pipeline
from planner.plan import Plan
from runtime.program import PAIR_AXIS, Instr, axis_group
from runtime.vocab import MeshAxis, StrategyName


class Bidirectional(Pipeline):
    """The bidirectional placement (see module docstring); passes as the one-directional pipeline's."""

    name = StrategyName.BIDIRECTIONAL
    title = "bidirectional pipeline (GEMS)"

    def active(self, plan: Plan) -> bool:
        return plan.config.bidirectional

    def schedule(self, lw: Lowering) -> dict[int, list[Instr]]:
        cfg = lw.plan.config
        try:
            return bidirectional(cfg.pipeline, cfg.replicas_per_direction)
        except ScheduleError as e:
            raise LoweringError(str(e)) from None

    def positions(self, lw: Lowering, stage: int) -> list[int]:
        return sorted({stage, lw.plan.config.pipeline - 1 - stage})

    def peer_position(self, lw: Lowering, stage: int, micro: int) -> int:
        return bidirectional_position(stage, micro, lw.plan.config.pipeline)

    def place(self, lw: Lowering, rp: RankPlan) -> RankPlan:
        stages = tuple(sorted({rp.position, lw.plan.config.pipeline - 1 - rp.position}))
        return rp.replace(stages=stages, grad_axis=PAIR_AXIS, grad_order=tuple(reversed(stages)),
                          grad_group=len(axis_group(lw.mesh, rp.coords, PAIR_AXIS)))

    def loss_instr(self, lw: Lowering, rp: RankPlan, handle: int) -> Instr:
        return Instr(Op.ALLREDUCE, kind=Kind.LOSS, axis=MeshAxis.PIPELINE, handle=handle, nbytes=8)


__all__ = ["Bidirectional"]
