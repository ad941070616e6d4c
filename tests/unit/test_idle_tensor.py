"""A tensor axis that splits nothing: the cost model keeps every tensor-parallel region replicated
(the example GPT at preset tiny on two A100s: its layers are too small for the collectives to pay), so
the tensor ranks repeat each other's work. Such a plan (fixed by make_plan, pinned by a constraint, or
the search's cheapest) says so in its summary and in planner.explain. And a sequence-parallel split
with no region to begin it is refused, not a crash (planner/strategies/tensor/split/sequence.py)."""

from __future__ import annotations

import pytest

import planner
from planner.graph.capture import capture_ref
from planner.strategies.tensor.split.analysis import SplitCache
from planner.strategies.tensor.split.sequence import SequenceSplitError, sequence_stream

NOTE = "the tensor axis splits nothing: every tensor-parallel region is cheaper replicated on dgx-a100-80gb, so " \
       "the 2 tensor ranks of each replica do the same work, as one device would"


@pytest.fixture(scope="module")
def tiny():
    return capture_ref("examples/models/gpt.py:build", {"preset": "tiny"}, batch_size=2)


@pytest.fixture(scope="module")
def cluster():
    return planner.Cluster.preset("dgx-a100-80gb", devices=2)


def _idle(plan) -> bool:
    return plan.config.tensor > 1 and not plan.shardings and not plan.config.sequence_parallel


def test_a_fixed_plan_whose_tensor_axis_splits_nothing_says_so(tiny, cluster):
    plan = planner.make_plan(tiny, cluster, planner.ParallelConfig(tensor=2, micro_batch_size=2, dtype="fp32"),
                             global_batch_size=4)
    assert _idle(plan)
    assert NOTE in plan.summary() and NOTE in planner.explain(plan)
    data = planner.make_plan(tiny, cluster, planner.ParallelConfig(data=2, micro_batch_size=2, dtype="fp32"),
                             global_batch_size=4)
    assert "splits nothing" not in data.summary() + planner.explain(data)


@pytest.mark.parametrize("constraints", [{"tensor": 2, "sequence_parallel": False},
                                         {"pipeline": 1, "subgraph": 1, "sequence_parallel": False}])
def test_a_searched_plan_whose_tensor_axis_splits_nothing_says_so(tiny, cluster, constraints):
    """Pinned to tensor 2, or one sample on two devices with no pipeline or sub-graph: the search's answer
    replicates every region over the tensor axis, and says so."""
    plan = planner.optimize(tiny, cluster, global_batch_size=1, progress=False, constraints=constraints)
    assert _idle(plan)
    assert NOTE in plan.summary() and NOTE in planner.explain(plan)


def test_a_sequence_split_with_no_region_to_begin_it_is_refused():
    """The output layer split by columns and gathered (a classifier head): nothing begins a split stream."""
    mlp = capture_ref("examples/models/mlp.py:build", {}, batch_size=2)
    head = {next(n.name for n in mlp.nodes if n.module_path == "net.4"): "column_out"}
    assert SplitCache(mlp).refusal(head, 2) is None
    with pytest.raises(SequenceSplitError, match="no region here ends in a row split"):
        sequence_stream(mlp, head, 2)
    assert "no region here ends in a row split" in SplitCache(mlp).refusal(head, 2, sequence=True)
