"""What a parallel strategy does to the lowering: the protocol of codegen/strategies/<name>.py.

codegen.lower.lower is a driver that knows no strategy by name. It asks the registry
(codegen/strategies/registry.py) for the strategies a plan uses and lets each one act at
fixed points of the lowering:

    lowered_plan     the plan whose Programs run (spatial: its data-parallel twin)
    rewrite_stages   the stage modules, rewritten (spatial: each stage's SpatialSpec)
    param_filter     which of a stage's parameters a rank holds (subgraph: its sub-grid's paths)
    plan_rank        fill in this rank's RankPlan (its stages, buckets, tied copies)
    passes           (Phase, pass) pairs over the rank's instruction list

Exactly one active strategy is the rank's `Placement` (pipeline or bidirectional): it says
where stages run, the per-position compute order, and over which group gradients are reduced.
A strategy overrides only the hooks it changes; the defaults leave the lowering as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Callable, Iterator, Protocol

from codegen.stages import Partition, StageCodeMaker, StagePart
from planner.graph.model import ModelGraph
from planner.plan import Plan
from runtime.program import Bucket, Instr, Program, Tie
from runtime.vocab import MeshAxis, StrategyName

Params = list[tuple[str, tuple[int, ...], str]]          # (name, local shape, dtype) of parameters
Pass = Callable[[list[Instr], Iterator[int]], list[Instr]]  # (instructions, handle counter) -> instructions
TiedCopies = dict[str, list[tuple[int, str, int]]]       # canonical name -> [(stage, local name, bytes)]


class LoweringError(ValueError):
    """A plan that cannot become Programs; the message names the reason."""


class Phase(IntEnum):
    """Where in a rank's step a pass acts; the driver runs passes phase by phase, and within a
    phase in registry order."""

    COMPUTE = 0      # around the schedule's forwards and backwards: point-to-point messages
    PARAMS = 1       # before each compute: parameter gathers (ZeRO-3)
    GRADS = 2        # after each stage's last backward: gradient collectives
    TIES = 3         # after the gradient collectives: sums of tied weights' copies
    STEP = 4         # around the optimizer step (the driver adds ZERO_GRAD and STEP first)
    AFTER_STEP = 5   # after the step: running statistics


@dataclass(frozen=True)
class Lowering:
    """What every rank's lowering reads, worked out once per plan.

    plan: the plan as lowered (a spatial plan's data-parallel twin); parts: its stage modules.
    num_micro_batches: per step and data rank. zero: the ZeRO stage the collectives implement
    (0 without a data axis). act_bytes / grad_bytes: stage -> bytes of its output activations /
    of their gradients for one micro-batch. stats_bytes: stage -> bytes of its BatchNorm running
    statistics. tied: weights held by several stages (codegen.lower.find_ties).
    bucket_bytes: gradient bucket cap. decay_of: a parameter's weight-decay class by its number of
    dims, when buckets must not mix classes (None: one class).
    """

    plan: Plan
    graph: ModelGraph
    parts: Partition
    num_micro_batches: int
    zero: int
    act_bytes: dict[int, int]
    grad_bytes: dict[int, int]
    stats_bytes: dict[int, int]
    tied: TiedCopies
    bucket_bytes: int
    decay_of: Callable[[int], bool] | None = None

    @property
    def mesh(self) -> tuple[tuple[str, int], ...]:
        """(axis, size), outermost first: pipeline, data, (subgraph), tensor."""
        return tuple(self.plan.config.mesh.items())

    @property
    def num_stages(self) -> int:
        return self.plan.config.num_stages

    @property
    def stage_parts(self) -> dict[int, StagePart]:
        return {sp.spec.index: sp for sp in self.parts.stages}


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of the lowering, filled in by the strategies' `plan_rank` hooks.

    stages: the stages it runs, ascending. grad_axis: the axis its gradients are reduced over;
    grad_group: that group's size; grad_order: the stages in the order their gradient
    collectives are issued (None: as their last backwards run). buckets: its gradient buckets;
    ties: its tied-weight copies.
    """

    rank: int
    coords: tuple[int, ...]
    stages: tuple[int, ...] = ()
    grad_axis: str = MeshAxis.DATA
    grad_group: int = 1
    grad_order: tuple[int, ...] | None = None
    buckets: tuple[Bucket, ...] = ()
    ties: tuple[Tie, ...] = ()

    @property
    def position(self) -> int:
        """This rank's pipeline position (the mesh's outermost coordinate)."""
        return self.coords[0]

    def replace(self, **changes) -> "RankPlan":
        return dataclasses.replace(self, **changes)


def _all_params(rp: RankPlan, params: Params) -> Params:
    return params


class LoweringStrategy(Protocol):
    """One parallel strategy's part in the lowering (see module docstring); subclass it and
    override the hooks the strategy changes."""

    name: StrategyName
    places_stages: bool = False   # a Placement (pipeline, bidirectional)
    # where its stage code exchanges data inside the layers (tiles, paths, sequence chunks), what the build's
    # messages call it, e.g. "spatial parallelism (--spatial)": compiled stages and the fused chunked loss do
    # not run with it (codegen/emit.py check_execution); None where it does not
    exchanges_in_layers: str | None = None

    def active(self, plan: Plan) -> bool:
        """Whether `plan` uses this strategy."""
        ...

    # whether this is the one strategy that splits nodes (planner/strategies/base.Strategy.splits_nodes):
    # codegen/partition.py asks it to apply the plan's split to the graph it cuts (split_stage_graph), at
    # every degree (at 1 it still specializes the graph to the build and gives every value's meta shape)
    splits_nodes: bool = False

    def split_stage_graph(self, plan: Plan, graph: ModelGraph, inputs: dict[str, Any], rewritten: Any = None,
                          attrs: dict[str, Any] | None = None) -> Any:
        """`graph.module`'s graph (or `rewritten`, whose runtime attributes' meta stand-ins are `attrs`) split as
        `plan` decides, run on the micro-batch's meta `inputs`: the graph, its split modules and parameters,
        and every value's local and full meta value (the strategy with splits_nodes only)."""
        raise NotImplementedError(f"the {self.name} strategy does not split nodes")

    def lowered_plan(self, plan: Plan) -> Plan:
        """The plan whose Programs run this one."""
        return plan

    def partition_options(self, plan: Plan, graph: ModelGraph) -> dict[str, Any]:
        """Keyword arguments for codegen.partition.partition, which writes the stage code (context: its
        rewrite of the captured graph)."""
        return {}

    def stage_code(self, plan: Plan, graph: ModelGraph) -> StageCodeMaker | None:
        """The maker of this strategy's parts of the stages' code (codegen/stage_parts.py; spatial: the
        tiles, sub-graph: the regions' calls), or None where it changes no stage's code."""
        return None

    def rewrite_stages(self, plan: Plan, graph: ModelGraph, parts: Partition) -> Partition:
        """The stage modules of the lowered plan, rewritten for `plan` (the plan as made)."""
        return parts

    def param_filter(self, lw: Lowering) -> Callable[[RankPlan, Params], Params]:
        """(rank, a stage's parameters) -> those the rank holds, by its coordinates; worked out once per plan."""
        return _all_params

    def plan_rank(self, lw: Lowering, rp: RankPlan, held: Callable[[int], Params]) -> RankPlan:
        """`rp` with this strategy's part filled in; held(stage): the parameters the rank holds."""
        return rp

    def passes(self, lw: Lowering, rp: RankPlan) -> list[tuple[Phase, Pass]]:
        """The passes this strategy adds to rank `rp`'s instruction list."""
        return []

    def finish_program(self, plan: Plan, graph: ModelGraph, program: Program) -> Program:
        """The rank's finished Program with this strategy's own part (spatial: its tile; Program.with_part)."""
        return program

    def reader_lines(self, program: Program) -> list[str]:
        """Lines for the reader's summary at the top of the rank's script (plain text: the caller quotes it)."""
        return []

    def torch_styles(self, plan: Plan, graph: ModelGraph) -> tuple[tuple[Any, ...], int | None] | None:
        """For the torch target (codegen/torch_target/layout.py): the torch styles (ModuleStyle) of the modules
        this strategy splits, in graph order, and the activations' sequence dimension where it splits them by
        sequence (else None); None where it splits no module."""
        return None


class Placement(LoweringStrategy, Protocol):
    """The strategy that places stages on pipeline positions (one per plan)."""

    places_stages = True
    # what a refusal calls the pipelines it places ("bidirectional pipeline (GEMS)")
    title: str = "pipeline"

    def schedule(self, lw: Lowering) -> dict[int, list[Instr]]:
        """Pipeline position -> its forwards and backwards ("F"/"B" instructions), in order."""
        ...

    def positions(self, lw: Lowering, stage: int) -> list[int]:
        """The pipeline positions that hold `stage`, ascending."""
        ...
