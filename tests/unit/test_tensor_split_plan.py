"""Tensor parallelism decided once: the planner stores the split of every value in the Plan, codegen
only applies it, a version-1 plan (roles only) still lowers alike, and roles the split analysis
cannot carry out are refused by make_plan and skipped by the search."""

import json

import pytest
import torch
from torch import nn

import planner
from codegen.partition import partition
from examples.models import gpt
from planner import ConfigError, NoFeasiblePlan, Plan
from planner.plan import PLAN_FORMAT_VERSION
from planner.strategies.tensor.split.analysis import SplitCache, tensor_splits
from planner.strategies.tensor.split.rules import TensorSplitError
from runtime.parallel.tensor.layers import FeatureSplit
from tests.fixed_machine import local_cluster


@pytest.fixture(scope="module")
def gpt_graph():
    with torch.device("meta"):
        model = gpt.build()
    return planner.capture(model, gpt.example_inputs(batch_size=2, device="meta"))


@pytest.fixture(scope="module")
def t2_plan(gpt_graph):
    cfg = planner.ParallelConfig(tensor=2, micro_batch_size=2, dtype="fp32")
    return planner.make_plan(gpt_graph, local_cluster(2), cfg, global_batch_size=4,
                             sharding="all")


def test_the_plan_stores_the_split_and_it_round_trips(t2_plan, gpt_graph, tmp_path):
    splits = t2_plan.tensor_splits
    assert t2_plan.format_version == PLAN_FORMAT_VERSION == 2
    assert splits is not None and splits.tensor == 2
    modules = {m.path: m for m in splits.modules}
    assert modules["blocks.0.attn.qkv"].split == FeatureSplit((3, 4, 8), 1)     # heads of q, k and v
    assert splits.output == FeatureSplit((128,), 0)                              # vocabulary-parallel logits
    assert splits == tensor_splits(gpt_graph, dict(t2_plan.shardings), 2)
    t2_plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == t2_plan


def test_a_version_1_plan_loads_and_lowers_as_the_stored_split(t2_plan, gpt_graph, tmp_path):
    doc = t2_plan.to_dict()
    doc.pop("tensor_splits")
    (tmp_path / "v1.json").write_text(json.dumps({**doc, "format_version": 1}))
    old = Plan.load(tmp_path / "v1.json")
    assert old.tensor_splits is None and old.format_version == 2
    assert old.shardings == t2_plan.shardings
    new, again = partition(t2_plan, gpt_graph), partition(old, gpt_graph)
    assert [s.source for s in new.stages] == [s.source for s in again.stages]
    assert [s.spec for s in new.stages] == [s.spec for s in again.stages]


def test_a_split_of_another_tensor_degree_is_refused(t2_plan):
    doc = t2_plan.to_dict()
    doc["tensor_splits"] = {**doc["tensor_splits"], "tensor": 4}
    with pytest.raises(ValueError, match="tensor_splits.tensor' is 4 but config.tensor is 2"):
        Plan.from_dict(doc)


class SoftmaxOverFeatures(nn.Module):
    """A column -> row region whose inner softmax runs across the split features: the roles
    the graph pattern finds cannot be carried out."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.softmax(self.a(x), dim=-1))


@pytest.fixture(scope="module")
def softmax_graph():
    with torch.device("meta"):
        return planner.capture(SoftmaxOverFeatures(), (torch.zeros(2, 8, device="meta"),))


def test_make_plan_refuses_roles_the_split_analysis_cannot_carry_out(softmax_graph):
    cfg = planner.ParallelConfig(tensor=2, micro_batch_size=2, dtype="fp32")
    with pytest.raises(ConfigError, match="cannot split node 'softmax'.*choose another tensor degree"):
        planner.make_plan(softmax_graph, local_cluster(2), cfg, global_batch_size=4,
                          sharding="all")


def test_the_search_skips_roles_the_split_analysis_refuses(softmax_graph):
    with pytest.raises(NoFeasiblePlan, match="tensor parallelism refused: .*'softmax'"):
        planner.optimize(softmax_graph, local_cluster(2), global_batch_size=4,
                         constraints={"tensor": 2}, runtime=None, sharding="all", progress=False)


def test_the_cache_remembers_failures(softmax_graph):
    cache = SplitCache(softmax_graph)
    roles = {"a": "column", "softmax": "inner", "b": "row"}
    for _ in range(2):
        with pytest.raises(TensorSplitError) as info:
            cache.get(roles, 2)
        assert info.value.node == "softmax"
    assert cache.get(roles, 1) is None and cache.refusal({}, 2) is None
