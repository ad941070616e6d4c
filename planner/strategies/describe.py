"""Each strategy's part in a plan's summary and in the checks a plan file passes when it loads.

Plan (planner/plan.py) writes the parts shared by every plan and reads these tables, in
registry order, for the rest. The tables read a plan as `PlanView` (a protocol of the Plan's fields
they use, which the Plan satisfies), so this module never imports planner/plan.py, which imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence, runtime_checkable

from planner.strategies.subgraph.regions import Region
from planner.strategies.subgraph.regions import describe as describe_regions
from runtime.vocab import MeshAxis, Schedule, StrategyName

if TYPE_CHECKING:
    from cost_models.hardware import Cluster
    from planner.config_fields import ConfigFields
    from planner.strategies.tensor.split.splits import TensorSplits


@runtime_checkable
class StageView(Protocol):
    """What these tables read of a planner.plan.Stage."""

    device_index: int
    layers: tuple[str, ...]


@runtime_checkable
class PlanView(Protocol):
    """What these tables read of a planner.plan.Plan (which satisfies it)."""

    config: "ConfigFields"
    cluster: "Cluster"
    stages: Sequence[StageView]
    shardings: tuple[tuple[str, str], ...]
    subgraph: tuple[Region, ...]
    tensor_splits: "TensorSplits | None"

# (field of the plan document, sentence saying what is wrong and what to do)
Problem = tuple[str, str]


def _bidirectional_schedule(c: "ConfigFields") -> str | None:
    if not c.bidirectional:
        return None
    return f"bidirectional (GEMS, {c.replicas_per_direction} pair(s): device r runs stages r and p-1-r)"


def _interleaved_chunks(c: "ConfigFields") -> str:
    return f" (v={c.virtual_stages})" if c.schedule == Schedule.INTERLEAVED else ""


def _spatial_line(c: "ConfigFields") -> str | None:
    if c.spatial == 1:
        return None
    return (f"  spatial: {c.spatial} tiles ({c.spatial_split}) per image through layer {c.spatial_until}, "
            f"BatchNorm statistics {c.spatial_batchnorm}; later layers replicated on the tiles' devices")


def _bidirectional_device(c: "ConfigFields", s: "StageView") -> str | None:
    """Device r runs stage r of one direction and stage p-1-r of the other."""
    return f"{s.device_index}/{c.pipeline - 1 - s.device_index}" if c.bidirectional else None


def _subgraph_section(plan: "PlanView") -> list[str]:
    if not plan.subgraph:
        return []
    c = plan.config
    return ["", f"  sub-graph parallelism: {c.subgraph} sub-grids per data replica (mesh axis '{MeshAxis.SUBGRAPH}')",
            *(f"    {ln}" for ln in describe_regions(plan.subgraph, c.subgraph))]


def idle_tensor_note(plan: "PlanView") -> str | None:
    """What a plan whose tensor axis splits nothing should say (None for any other plan): the cost model
    found every tensor-parallel region cheaper replicated on this cluster (small layers, slow links), so
    the tensor ranks of each replica would repeat each other's work."""
    t = plan.config.tensor
    if t == 1 or plan.shardings or plan.config.sequence_parallel:   # sequence parallelism splits the tokens
        return None
    return (f"the tensor axis splits nothing: every tensor-parallel region is cheaper replicated on "
            f"{plan.cluster.name}, so the {t} tensor ranks of each replica do the same work, as one device would "
            "(no speed or memory gained; the cost model found that cheaper than giving them other work)")


def _tensor_section(plan: "PlanView") -> list[str]:
    note = idle_tensor_note(plan)
    return ["", f"  note: {note}"] if note else []


# Strategies that run a schedule of their own name it in place of ParallelConfig.schedule.
SCHEDULE_NAMES: tuple[tuple[StrategyName, Callable[["ConfigFields"], str | None]], ...] = (
    (StrategyName.BIDIRECTIONAL, _bidirectional_schedule),
)
# Text right after the schedule's name.
SCHEDULE_DETAILS: tuple[tuple[StrategyName, Callable[["ConfigFields"], str]], ...] = (
    (StrategyName.PIPELINE, _interleaved_chunks),
)
# Lines right after the mesh line.
CONFIG_LINES: tuple[tuple[StrategyName, Callable[["ConfigFields"], str | None]], ...] = (
    (StrategyName.SPATIAL, _spatial_line),
)
# The stage table's "dev" column, where a strategy places a stage on more than one position.
STAGE_DEVICES: tuple[tuple[StrategyName, Callable[["ConfigFields", "StageView"], str | None]], ...] = (
    (StrategyName.BIDIRECTIONAL, _bidirectional_device),
)
# Lines right after the stage table.
SECTIONS: tuple[tuple[StrategyName, Callable[["PlanView"], list[str]]], ...] = (
    (StrategyName.TENSOR, _tensor_section),
    (StrategyName.SUBGRAPH, _subgraph_section),
)


def schedule_text(c: "ConfigFields") -> str:
    """The summary's schedule: its name and details, e.g. "interleaved (v=2)"."""
    name = next((n for _, name_of in SCHEDULE_NAMES if (n := name_of(c))), c.schedule)
    return name + "".join(detail(c) for _, detail in SCHEDULE_DETAILS)


def config_lines(c: "ConfigFields") -> list[str]:
    """The strategies' lines under the summary's mesh line."""
    return [ln for _, line in CONFIG_LINES if (ln := line(c)) is not None]


def stage_device(c: "ConfigFields", s: "StageView") -> str:
    """The pipeline position(s) that run stage `s`, as the summary's stage table shows them."""
    return next((d for _, device in STAGE_DEVICES if (d := device(c, s))), str(s.device_index))


def sections(plan: "PlanView") -> list[str]:
    """The strategies' sections under the summary's stage table."""
    return [ln for _, section in SECTIONS for ln in section(plan)]


def _pipeline_problems(plan: "PlanView") -> Iterator[Problem]:
    for k, st in enumerate(plan.stages):
        if st.device_index >= plan.config.pipeline:
            yield f"stages[{k}].device_index", f"is {st.device_index}; the pipeline has {plan.config.pipeline} devices"


def _spatial_problems(plan: "PlanView") -> Iterator[Problem]:
    until = plan.config.spatial_until
    if until is not None and not any(until in st.layers for st in plan.stages):
        yield "config.spatial_until", f"is {until!r}, which no stage holds; name the last spatially split layer"


def _subgraph_problems(plan: "PlanView") -> Iterator[Problem]:
    c, regions = plan.config, plan.subgraph
    if (c.subgraph > 1) != bool(regions):
        yield "subgraph", (f"lists {len(regions)} split regions but config.subgraph is {c.subgraph}; "
                           "make the plan again")
    for k, r in enumerate(regions):
        if max(r.owners) >= c.subgraph:
            yield f"subgraph[{k}]", f"gives a path to sub-grid {max(r.owners)}; there are {c.subgraph}"


def _tensor_problems(plan: "PlanView") -> Iterator[Problem]:
    splits = plan.tensor_splits
    if splits is not None and splits.tensor != plan.config.tensor:
        yield "tensor_splits.tensor", (f"is {splits.tensor} but config.tensor is {plan.config.tensor}; "
                                       "make the plan again")


# registry order; strategies without checks of their own are left out
PLAN_CHECKS: tuple[tuple[StrategyName, Callable[["PlanView"], Iterator[Problem]]], ...] = (
    (StrategyName.TENSOR, _tensor_problems),
    (StrategyName.PIPELINE, _pipeline_problems),
    (StrategyName.SPATIAL, _spatial_problems),
    (StrategyName.SUBGRAPH, _subgraph_problems),
)


def plan_problems(plan: "PlanView") -> Iterator[Problem]:
    """What each strategy finds wrong with a plan read from a file, in registry order."""
    for _, problems in PLAN_CHECKS:
        yield from problems(plan)
