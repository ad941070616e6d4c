"""`planner.fixed_plan`: the Plan for a configuration the user fixes (`planner.make_plan`).

Hand-picked and searched plans travel the same road: both come out of
`plan_for`, which turns an Evaluator's verdict on one ParallelConfig into a
Plan (stage layer lists, tensor-parallel roles by node name and the split they make,
prediction).
"""

from __future__ import annotations

from typing import Any

from cost_models.hardware import Cluster
from cost_models.overlap import Overlap
from cost_models.step_costs import StepSetup
from planner.capabilities import RuntimeSupport, TargetError
from planner.config import ParallelConfig
from planner.evaluator import Evaluator, as_graph
from planner.execution_choice import choose
from planner.plan import PLAN_FORMAT_VERSION, Plan, Stage
from planner.strategies import describe
from planner.strategies.base import SplitAnalysis
from runtime.vocab import Target


def plan_for(ev: Evaluator, config: ParallelConfig, global_batch_size: int, search: tuple = (),
             splits: SplitAnalysis | None = None, roles: dict[str, str] | None = None,
             target: Target = Target.MESHPLAN) -> Plan:
    """The Plan for `config` as `ev` prices it, with its tensor-parallel split decided (`splits`:
    the search's cache of split analyses, if it has one). `roles`: the tensor-parallel roles
    (fx node name -> role) to split by instead of the evaluator's choice for `config`. `target`:
    what the plan is for (recorded in it; the caller has checked that the target runs it).

    Raises ConfigError naming the node when the tensor-parallel roles cannot be carried out.
    """
    pred = ev.evaluate(config, global_batch_size)
    costs = ev.layer_costs(config)
    bounds = ev.stage_bounds(config, costs, global_batch_size)
    names = [layer.name for layer in ev.graph.layers]
    stages = tuple(Stage(index=k, device_index=k % config.pipeline, layers=tuple(names[lo:hi]))
                   for k, (lo, hi) in enumerate(bounds))
    roles = ev.node_roles(config) if roles is None else roles
    tensor_splits = (splits or ev.splitter.split_analysis(ev.graph)).for_plan(roles, config)
    return Plan(format_version=PLAN_FORMAT_VERSION, model_class=ev.graph.model_class,
                graph_fingerprint=ev.graph.fingerprint, cluster=ev.cluster, config=config,
                global_batch_size=global_batch_size, stages=stages, shardings=tuple(sorted(roles.items())),
                prediction=pred, search=tuple(search), parts=_plan_parts(ev, config),
                tensor_splits=tensor_splits, target=Target(target).value, graph_params=ev.graph.num_params,
                execution=ev.execution)


def _plan_parts(ev: Evaluator, config: ParallelConfig) -> tuple:
    """The strategies' own parts of the plan for `config`, in the order a plan file lists them."""
    made = {type(p): p for s in ev.strategies if (p := s.plan_part(ev.graph, config)) is not None}
    return tuple(made[kind] for kind in describe.plan_parts() if kind in made)


def make_plan(model_or_graph: Any, cluster: Cluster, config: ParallelConfig, *, global_batch_size: int,
              example_inputs: Any = None, target: Target | str | None = None, **evaluator_options: Any) -> Plan:
    """Build the Plan for a fixed ParallelConfig (stages balanced unless the config names them).

    `target` (a runtime.vocab.Target or its string): the plan is for that target, which must run
    `config`; None makes the plan for meshplan's runtime without asking whether it runs it (a what-if
    plan, as before targets existed).

    Raises ConfigError (ValueError) naming the numbers when the config cannot run; TargetError (a
    ConfigError) naming the target and the strategy when `target` does not run it.
    """
    support = None if target is None else RuntimeSupport.for_target(target)
    why = support.why_not(config, global_batch_size) if support is not None else None
    if why:
        raise TargetError(f"make_plan for {config.short()}: {why}")
    graph = as_graph(model_or_graph, example_inputs)
    if support is None:
        ev = Evaluator(graph, cluster, **evaluator_options)
        if "execution" not in evaluator_options:   # the options that pay for this config (execution_choice)
            ev, _ = choose(ev, config, global_batch_size)
        return plan_for(ev, config, global_batch_size)
    # priced with what the target's stack overlaps, unless told otherwise
    ev = Evaluator(graph, cluster, **{"overlap": Overlap.preset(support.stack), **evaluator_options})
    ev.sharding = support.splittable(graph, ev.sharding, [ev.split_ranks(config)])   # the regions the target splits
    plan = plan_for(ev, config, global_batch_size, target=support.target)
    why = support.why_not_splits(config, plan.tensor_splits)
    if why:
        raise TargetError(f"make_plan for {config.short()}: {why}")
    return plan


def make_fixed_plan(graph, cluster, cfg, global_batch_size: int, target: Target = Target.MESHPLAN,
                    setup: StepSetup | None = None):
    """make_plan for a fixed config, with every tensor-parallel region the graph offers that `target`
    can split (Megatron's layout), whatever regions the evaluator's own search would keep; priced for the
    step `setup` describes (default: AdamW, cross-entropy) and, for meshplan's runtime, at the execution
    options that pay for it there (planner/execution_choice.py)."""
    support = RuntimeSupport.for_target(target)
    ev = Evaluator(graph, cluster, setup=setup)
    if support.target == Target.MESHPLAN:   # the execution options that pay for it (codegen flags override them)
        ev, _ = choose(ev, cfg, global_batch_size)
    roles = None
    if ev.split_ranks(cfg) > 1:
        sharding = support.splittable(graph, ev.sharding, [ev.split_ranks(cfg)])
        roles = {n: r.role for n, r in sharding.roles.items() if r.sharded}
    return plan_for(ev, cfg, global_batch_size, roles=roles, target=support.target)
