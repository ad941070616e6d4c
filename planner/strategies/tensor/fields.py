"""Tensor parallelism's ParallelConfig fields (planner/strategies/field_hooks.py): `tensor` and
`sequence_parallel`, and what a plan says of its splits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from planner.strategies.field_hooks import FieldFlag, PlanView, Problem, StrategyFields
from planner.strategies.tensor.split.splits import TensorSplits
from runtime.vocab import StrategyName

if TYPE_CHECKING:
    from planner.config_fields import ConfigFields


def idle_tensor_note(plan: PlanView) -> str | None:
    """What a plan whose tensor axis splits nothing should say (None for any other plan): the cost model
    found every tensor-parallel region cheaper replicated on this cluster (small layers, slow links), so
    the tensor ranks of each replica would repeat each other's work."""
    t = plan.config.tensor
    if t == 1 or plan.shardings or plan.config.sequence_parallel:   # sequence parallelism splits the tokens
        return None
    return (f"the tensor axis splits nothing: every tensor-parallel region is cheaper replicated on "
            f"{plan.cluster.name}, so the {t} tensor ranks of each replica do the same work, as one device would "
            "(no speed or memory gained; the cost model found that cheaper than giving them other work)")


class TensorFields(StrategyFields):
    name = StrategyName.TENSOR
    flags = (FieldFlag("tensor", "tensor degree (default 1)"),
             FieldFlag("sequence_parallel", "Megatron sequence parallelism inside the tensor axis (needs --tensor >= 2)"))
    node_splits = TensorSplits
    split_degree = "tensor"

    def refusal(self, c: "ConfigFields") -> str | None:
        """Sequence parallelism shards the stream between tensor-parallel regions over the tensor ranks."""
        if not isinstance(c.sequence_parallel, bool):
            return f"ParallelConfig.sequence_parallel must be true or false, got {c.sequence_parallel!r}"
        if c.sequence_parallel and c.tensor < 2:
            return "sequence_parallel needs tensor >= 2 (it splits the sequence over the tensor-parallel ranks)"
        return None

    def unused(self, c: "ConfigFields") -> tuple[str, ...]:
        return ("sequence_parallel",) if not c.sequence_parallel else ()

    def label(self, c: "ConfigFields") -> str:
        return " sp" if c.sequence_parallel else ""

    def section(self, plan: PlanView) -> list[str]:
        note = idle_tensor_note(plan)
        return ["", f"  note: {note}"] if note else []

    def explain_lines(self, plan: PlanView) -> list[str]:
        note = idle_tensor_note(plan)
        return [f"  note: {note}"] if note else []

    def plan_problems(self, plan: PlanView) -> Iterator[Problem]:
        splits = plan.tensor_splits
        if splits is not None and splits.tensor != plan.config.tensor:
            yield "tensor_splits.tensor", (f"is {splits.tensor} but config.tensor is {plan.config.tensor}; "
                                           "make the plan again")


__all__ = ["TensorFields", "idle_tensor_note"]
