"""Context parallelism in the lowering: a plan with context degree c runs as its data-parallel twin
(data x c ranks on the data axis, c times the global batch), every run of c consecutive data
coordinates holding the chunks of the same sequences.

What is shared with data parallelism is the gradient arithmetic: each rank's loss is the mean over
its own tokens, scaled by 1/(data x c) (equal token counts per rank), and the gradient
collectives of the data axis (all-reduce, or ZeRO's reduce-scatter and parameter gathers) run over
data x context, as Megatron reduces gradients and shards its distributed optimizer over the
data-parallel x context-parallel group. What is context-parallel is said where it runs: the
stage code takes this rank's tokens and positions and calls context attention
(codegen/strategies/context/stage_code.py), and each rank's Program names its context group and the sequence
(runtime.parallel.context.part.ContextShard).
"""

from __future__ import annotations

import dataclasses
import functools

from codegen.strategies.context.stage_code import ContextSpec, context_graph, context_spec
from codegen.strategies.base import LoweringError, LoweringStrategy
from planner.graph.model import ModelGraph
from planner.plan import Plan
from planner.strategies.combinations import Level, why_not
from runtime.parallel.context.part import ContextShard
from runtime.program import Program
from runtime.vocab import ContextAttention, MeshAxis, StrategyName


def context_twin(plan: Plan) -> Plan:
    """The data-parallel plan whose Programs a context-parallel plan runs (see module docstring)."""
    c = plan.config
    why = why_not(c, Level.RUNTIME)   # the combinations the runtime runs
    if why:
        raise LoweringError(f"{why}; plan within those limits (or with context=1)")
    twin = c.replace(data=c.data * c.context, context=1, context_attention=ContextAttention.RING)
    return dataclasses.replace(plan, config=twin, global_batch_size=plan.global_batch_size * c.context)


def _spec(plan: Plan, graph: ModelGraph) -> ContextSpec:
    return context_spec(graph, plan.config.context, ContextAttention(plan.config.context_attention).value)


def context_shard(program: Program, spec: ContextSpec) -> ContextShard:
    """The rank's context group: the run of `degree` consecutive data coordinates holding its sequences."""
    data = program.group(MeshAxis.DATA)
    k = program.coord(MeshAxis.DATA) // spec.degree
    return ContextShard(spec.degree, spec.seq_len, spec.dim, data[k * spec.degree:(k + 1) * spec.degree])


class Context(LoweringStrategy):
    """Sequence chunks over c ranks in every layer (the context mesh axis)."""

    name = StrategyName.CONTEXT
    exchanges_in_layers = "context parallelism (--context)"

    def active(self, plan: Plan) -> bool:
        return plan.config.context > 1

    def lowered_plan(self, plan: Plan) -> Plan:
        return context_twin(plan)

    def partition_options(self, plan: Plan, graph: ModelGraph) -> dict:
        return {"rewrite": functools.partial(context_graph, graph=graph, spec=_spec(plan, graph))}

    def finish_program(self, plan: Plan, graph: ModelGraph, program: Program) -> Program:
        return program.with_part(context_shard(program, _spec(plan, graph)))

    def reader_lines(self, program: Program) -> list[str]:
        """The rank's sequence chunks and its context group."""
        shard = program.part(ContextShard.key)
        c, k = shard.degree, shard.index(program.rank)
        return [f"Context: ranks {list(shard.ranks)} share each sequence of {shard.seq_len} tokens; this "
                f"rank holds chunks {k} and {2 * c - 1 - k} of {2 * c} (the data axis holds data x context {c})"]


__all__ = ["Context", "context_shard", "context_twin"]
