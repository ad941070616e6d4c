"""planner/strategies/: one registry of strategies, and one combination table that ParallelConfig, the
runtime's capabilities (the search) and codegen all answer from."""

import dataclasses

import pytest

from planner import ConfigError, ParallelConfig
from planner.capabilities import MESHPLAN_RUNTIME
from planner.strategies.base import Placement
from planner.config_fields import ConfigFields
from planner.strategies.combinations import RULES, Level, why_not
from planner.strategies.fields import FIELDS
from planner.strategies.registry import STRATEGIES
from runtime.vocab import StrategyName


def test_registry_lists_every_strategy_once_under_its_module_name():
    assert [s.name for s in STRATEGIES] == list(StrategyName)
    for s in STRATEGIES:
        # a strategy's home is a module, or a package whose hook module is `strategy`
        assert type(s).__module__ in (f"planner.strategies.{s.name}", f"planner.strategies.{s.name}.strategy")


def test_every_strategy_says_what_its_fields_are_in_its_home_in_registry_order():
    """planner/strategies/fields.py lists one fields module per strategy (its checks, label, plan text and
    flags), in registry order; every ParallelConfig field is some strategy's flag or one of the few every
    plan has, so a new dimension's field reaches `meshplan codegen` through its own home."""
    assert [f.name for f in FIELDS] == [s.name for s in STRATEGIES]
    for f in FIELDS:
        assert type(f).__module__ == f"planner.strategies.{f.name}.fields"
    flagged = [fl.field for f in FIELDS for fl in f.flags]
    shared = {"micro_batch_size", "recompute", "dtype", "stage_boundaries"}
    assert len(flagged) == len(set(flagged)) and not set(flagged) & shared
    assert set(flagged) | shared == {f.name for f in dataclasses.fields(ConfigFields)}


def test_the_last_active_placement_prices_the_step():
    placements = [s for s in STRATEGIES if isinstance(s, Placement)]
    assert [s.name for s in placements] == [StrategyName.PIPELINE, StrategyName.BIDIRECTIONAL]
    plain = ParallelConfig(pipeline=2)
    bidi = ParallelConfig(pipeline=2, bidirectional=True)
    assert [s.name for s in placements if s.active(plain)] == [StrategyName.PIPELINE]
    assert [s.name for s in placements if s.active(bidi)][-1] == StrategyName.BIDIRECTIONAL


# One config per rule (same order as RULES), valid in every other respect.
REFUSED = (
    dict(pipeline=2, bidirectional=True, schedule="gpipe"),
    dict(pipeline=2, data=2, bidirectional=True, zero=1),
    dict(subgraph=2, tensor=2, recompute="full"),
    dict(context=2, spatial=2, spatial_until="conv"),
    dict(spatial=2, spatial_until="conv", tensor=2, schedule="interleaved", virtual_stages=2, pipeline=2),
    dict(context=2, tensor=2, sequence_parallel=True),
    dict(subgraph=2, data=2, zero=2),
)


def _unchecked(**fields) -> ParallelConfig:
    """A ParallelConfig built without __post_init__ (to ask the table about configs it refuses)."""
    cfg = object.__new__(ParallelConfig)
    for f in dataclasses.fields(ParallelConfig):
        object.__setattr__(cfg, f.name, fields.get(f.name, f.default))
    return cfg


@pytest.mark.parametrize("rule, fields", list(zip(RULES, REFUSED)), ids=[f"{r.strategy}-{r.level}" for r in RULES])
def test_each_rule_refuses_where_its_level_says(rule, fields):
    why = rule.why_not(_unchecked(**fields))
    assert why and why == why_not(_unchecked(**fields), rule.level)
    if rule.level == Level.CONFIG:
        with pytest.raises(ConfigError) as e:
            ParallelConfig(**fields)
        assert str(e.value) == why
    else:
        assert MESHPLAN_RUNTIME.why_not(ParallelConfig(**fields)) == why


def test_a_refusal_names_every_conflict_present():
    why = why_not(_unchecked(subgraph=2, tensor=2, spatial=2, spatial_until="x", recompute="full"), Level.CONFIG)
    assert why == ("subgraph=2 does not combine with tensor > 1, spatial > 1, recompute='full' yet; "
                   "use subgraph=1 or drop those")
    assert why_not(ParallelConfig(subgraph=2, data=2), Level.CONFIG) is None
    assert why_not(ParallelConfig(spatial=2, spatial_until="x", pipeline=2, bidirectional=True), Level.RUNTIME) is None


def test_the_protocols_the_strategies_see_are_satisfied():
    """The Evaluator is what the strategies' hooks read as Pricing, a Plan what describe.py reads as a
    PlanView (each protocol lists members; a member the real class lacks fails here)."""
    from planner.evaluator import Evaluator
    from planner.strategies.base import Pricing
    from planner.strategies.field_hooks import PlanView, StageView
    from tests.parallel_cases import plan_for, graph_of

    plan = plan_for("gpt", global_batch=4, data=2)
    ev = Evaluator(graph_of("gpt"), plan.cluster)
    assert isinstance(ev, Pricing) and isinstance(plan, PlanView) and isinstance(plan.stages[0], StageView)
    assert not isinstance(object(), Pricing) and not isinstance(plan.config, PlanView)
