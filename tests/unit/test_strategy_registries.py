"""The strategy registries of codegen (codegen/strategies/) and the runtime (runtime/parallel/):
each strategy is listed once, under its own module's name, and every plan has one placement."""

from codegen.strategies import registry as lowering
from runtime.parallel import registry as running
from tests.parallel_cases import plan_for
from runtime.vocab import StrategyName


def _check_names(strategies, package: str) -> None:
    names = [s.name for s in strategies]
    assert len(set(names)) == len(names), names
    for s in strategies:
        assert isinstance(s.name, StrategyName)
        # a strategy's home is a module, or a package whose hook module is `strategy`
        assert type(s).__module__ in (f"{package}.{s.name}", f"{package}.{s.name}.strategy")


def test_each_strategy_is_listed_once_under_its_module_name():
    _check_names(lowering.STRATEGIES, "codegen.strategies")
    _check_names(running.STRATEGIES, "runtime.parallel")


def test_every_plan_has_one_placement():
    for cfg, name in ((dict(data=2), StrategyName.PIPELINE), (dict(pipeline=2), StrategyName.PIPELINE),
                      (dict(pipeline=2, bidirectional=True), StrategyName.BIDIRECTIONAL)):
        plan = plan_for("gpt", global_batch=4, **cfg)
        assert lowering.placement(lowering.active(plan)).name == name
