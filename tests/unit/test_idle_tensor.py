"""A tensor axis that splits nothing: the cost model keeps every tensor-parallel region replicated
(the example GPT at preset tiny on two A100s: its layers are too small for the collectives to pay),
so the tensor ranks would repeat each other's work. The search does not choose such a configuration
while another fits; a plan that has one (pinned by a constraint or fixed by make_plan) says so in
its summary and in planner.explain."""

from __future__ import annotations

import pytest

import planner
from planner.graph.capture import capture_ref
from planner.search import IDLE_TENSOR_REASON

NOTE = "the tensor axis splits nothing: every tensor-parallel region is cheaper replicated on dgx-a100-80gb, so " \
       "the 2 tensor ranks of each replica do the same work; use tensor=1"


@pytest.fixture(scope="module")
def tiny():
    return capture_ref("examples/models/gpt.py:build", {"preset": "tiny"}, batch_size=2)


@pytest.fixture(scope="module")
def cluster():
    return planner.Cluster.preset("dgx-a100-80gb", devices=2)


def test_a_fixed_plan_whose_tensor_axis_splits_nothing_says_so(tiny, cluster):
    plan = planner.make_plan(tiny, cluster, planner.ParallelConfig(tensor=2, micro_batch_size=2, dtype="fp32"),
                             global_batch_size=4)
    assert plan.shardings == ()
    assert NOTE in plan.summary() and NOTE in planner.explain(plan)
    data = planner.make_plan(tiny, cluster, planner.ParallelConfig(data=2, micro_batch_size=2, dtype="fp32"),
                             global_batch_size=4)
    assert "splits nothing" not in data.summary() + planner.explain(data)


def test_the_search_passes_over_it_unless_tensor_is_pinned(tiny, cluster):
    plan = planner.optimize(tiny, cluster, global_batch_size=4, progress=False, keep_alternatives=100)
    assert plan.config.tensor == 1
    idle = [a for a in plan.alternatives if a.config.tensor > 1]
    assert idle and all(a.reason == IDLE_TENSOR_REASON for a in idle)
    pinned = planner.optimize(tiny, cluster, global_batch_size=4, progress=False, constraints={"tensor": 2})
    assert pinned.config.tensor == 2 and pinned.shardings == ()
    assert NOTE in pinned.summary() and NOTE in planner.explain(pinned)


def test_it_is_chosen_when_nothing_else_fits(tiny, cluster):
    """One sample on two devices: no data split; the tensor axis idles, or a pipeline or sub-graph does."""
    plan = planner.optimize(tiny, cluster, global_batch_size=1, progress=False,
                            constraints={"pipeline": 1, "subgraph": 1, "sequence_parallel": False})
    assert plan.config.tensor == 2 and NOTE in plan.summary()
