"""Fuzz the Plan, Cluster and Program loaders with damaged documents: only the documented errors, never a crash."""

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import planner
from cost_models.cluster_file import ClusterFileError
from cost_models.hardware import Cluster
from examples.models import gpt
from planner import Plan, PlanFileError
from fuzz_mutations import mutate, sample_program_docs  # tests/unit is on sys.path (pytest prepend mode)
from runtime.program import Program, ProgramError
from runtime.vocab import MeshAxis


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
    _load_damaged_file(tmp_path_factory, plan_doc, cut, junk, Plan.load, PlanFileError)


def _load_damaged_file(tmp_path_factory, doc, cut, junk, load, error) -> None:
    """Write the first `cut` characters of `doc` as JSON plus `junk` bytes; loading raises only `error`."""
    text = json.dumps(doc)
    path = tmp_path_factory.mktemp("fuzz") / "doc.json"
    path.write_bytes(text[: cut % (len(text) + 1)].encode() + junk)
    try:
        load(path)
    except error:
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


@pytest.fixture(scope="module")
def program_docs():
    return sample_program_docs()


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 4), which=st.integers(0, 2))
def test_damaged_programs_are_rejected_cleanly(program_docs, seed, steps, which):
    doc = mutate(program_docs[which], random.Random(seed), steps)
    try:
        prog = Program.from_dict(doc)
    except ProgramError as e:
        assert str(e)
        return
    assert Program.from_dict(prog.to_dict()) == prog  # what loads is a consistent Program


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 100_000), junk=st.binary(max_size=8))
def test_truncated_or_corrupt_program_files(program_docs, tmp_path_factory, cut, junk):
    _load_damaged_file(tmp_path_factory, program_docs[0], cut, junk, Program.load, ProgramError)


def test_real_programs_load(program_docs):
    for doc in program_docs:
        assert Program.from_dict(json.loads(json.dumps(doc))).to_dict() == doc


def _edit(doc, path, value):
    import copy

    doc = copy.deepcopy(doc)
    node = doc
    for k in path[:-1]:
        node = node[k]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


def _first(doc, *ops, kind=None):
    return next(i for i, ins in enumerate(doc["instrs"]) if ins["op"] in ops and kind in (None, ins.get("kind")))


@pytest.mark.parametrize("path,value,needle", [
    (("format_version",), 2, "'format_version' is 2; this runtime reads 1"),
    (("rank",), 4, "'rank' must be <= 3, got 4"),
    (("world_size",), "4", "'world_size' must be a whole number, got '4'"),
    (("mesh", 0), [MeshAxis.PIPELINE], "'mesh[0]' must be [axis name, size]"),
    (("mesh", 1, 1), 3, "'mesh' has 6 ranks but world_size is 4"),
    (("coords", 2), 1, "'coords[2]' must be <= 0, got 1"),
    (("stages",), [1, 0], "'stages' must be distinct and ascending"),
    (("num_micro_batches",), 0, "'num_micro_batches' must be >= 1, got 0"),
    (("zero",), 4, "'zero' must be <= 3, got 4"),
    (("buckets", 0, "stage"), 1, "'buckets[0].stage' is 1, not one of this rank's stages [0]"),
    (("buckets", 0, "numel"), KeyError, "'buckets[0].numel' is missing"),
    (("instrs",), {}, "'instrs' must be a list, got dict"),
    (("instrs", 0, "colour"), "red", "'instrs[0]' has unknown key(s) ['colour']"),
])
def test_program_messages_name_the_field(program_docs, path, value, needle):
    with pytest.raises(ProgramError) as info:
        Program.from_dict(_edit(program_docs[0], path, value))
    assert needle in str(info.value) and "generate the build again" in str(info.value)


def test_program_cross_references_are_checked(program_docs):
    doc = program_docs[0]
    send, wait, coll = _first(doc, "SEND"), _first(doc, "WAIT"), _first(doc, "ALLREDUCE", "REDUCESCATTER", kind="grads")
    for path, value, needle in [
        (("instrs", send, "peer"), 4, f"'instrs[{send}].peer' is rank 4, outside the world of 4 ranks"),
        (("instrs", wait, "handle"), 999, f"'instrs[{wait}].handle' waits on h999, which no earlier instruction"),
        (("instrs", coll, "axis"), "space", f"'instrs[{coll}].axis' is 'space', not an axis of the mesh"),
        (("instrs", coll, "bucket"), 7, f"'instrs[{coll}].bucket' is 7; this rank has"),
        (("instrs", _first(doc, "F"), "micro"), 9, "micro' is 9, a step has 2 micro-batches"),
        (("instrs", _first(doc, "F"), "stage"), 1, "stage' is 1, not one of this rank's stages [0]"),
    ]:
        with pytest.raises(ProgramError) as info:
            Program.from_dict(_edit(doc, path, value))
        assert needle in str(info.value), str(info.value)
    dup = _edit(doc, ("instrs", coll, "handle"), doc["instrs"][send]["handle"])
    with pytest.raises(ProgramError, match="is created twice"):
        Program.from_dict(dup)
