"""Fuzz the Plan and Cluster loaders with damaged documents: only the documented errors, never a crash."""

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import planner
from cost_models.hardware import Cluster, ClusterFileError
from examples.models import gpt
from planner import Plan, PlanFileError
from fuzz_mutations import mutate  # tests/unit is on sys.path (pytest prepend mode)


@pytest.fixture(scope="module")
def plan_doc():
    with torch.device("meta"):
        model = gpt.build(preset="tiny")
    graph = planner.capture(model, gpt.example_inputs(batch_size=2, device="meta", preset="tiny"))
    plan = planner.optimize(graph, Cluster.preset("dgx-a100-80gb", nodes=2), global_batch_size=32, progress=False)
    return plan.to_dict()


FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 4))
def test_damaged_plans_are_rejected_cleanly(plan_doc, seed, steps):
    doc = mutate(plan_doc, random.Random(seed), steps)
    try:
        plan = Plan.from_dict(doc, origin="fuzz.json")
    except PlanFileError as e:
        assert "fuzz.json" in str(e)
        return
    assert isinstance(plan, Plan)  # a harmless mutation (e.g. an extra search key) still loads


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 4),
       preset=st.sampled_from(["dgx-a100-80gb", "dgx-h100", "summit"]))
def test_damaged_clusters_are_rejected_cleanly(seed, steps, preset):
    doc = mutate(Cluster.preset(preset).to_dict(), random.Random(seed), steps)
    try:
        cluster = Cluster.from_dict(doc, origin="fuzz.yaml")
    except ClusterFileError as e:
        assert "fuzz.yaml" in str(e)
        return
    assert cluster.num_devices >= 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 10_000), junk=st.binary(max_size=8))
def test_truncated_or_corrupt_files(plan_doc, tmp_path_factory, cut, junk):
    text = json.dumps(plan_doc)
    path = tmp_path_factory.mktemp("fuzz") / "plan.json"
    path.write_bytes(text[: cut % (len(text) + 1)].encode() + junk)
    try:
        Plan.load(path)
    except PlanFileError:
        pass


def test_a_good_plan_still_loads(plan_doc, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_doc))
    loaded = Plan.load(path)
    assert Plan.from_dict(plan_doc) == loaded  # in memory (tuples) and from JSON (lists) alike
    assert json.loads(json.dumps(loaded.to_dict())) == json.loads(json.dumps(plan_doc))


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d.pop("stages"), "field 'stages' is missing"),
    (lambda d: d["config"].update(pipeline="2"), "config.pipeline' must be a whole number"),
    (lambda d: d["stages"][0].update(layers=[]), "stages[0].layers' is empty"),
    (lambda d: d["prediction"].update(step_time=-1), "prediction.step_time' must be >= 0"),
    (lambda d: d.update(format_version=99), "format_version' is 99"),
    (lambda d: d["config"].update(data=d["config"]["data"] * 2), "devices but the plan's cluster has"),
])
def test_messages_name_the_field(plan_doc, edit, needle):
    import copy

    doc = copy.deepcopy(plan_doc)
    edit(doc)
    with pytest.raises(PlanFileError) as info:
        Plan.from_dict(doc, origin="p.json")
    assert needle in str(info.value)
