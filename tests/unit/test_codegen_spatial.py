"""Lowering spatial plans (codegen/strategies/spatial/strategy.py, codegen/strategies/spatial/program.py): the data-parallel twin's
Programs plus each stage's SpatialSpec; plans the runtime cannot run with tiles are refused naming the knob."""

import pytest

import planner
from codegen.emit import capture_ref
from codegen.lower import LoweringError, lower_plan
from codegen.strategies.spatial.program import spatial_twin
from runtime.spec import StageSpec
from runtime.vocab import MeshAxis

REF = "examples/models/large_image_cnn.py:build"
KW = {"image_size": 64, "layers": [[4, 3, 1], [4, 3, 2]], "num_classes": 3, "in_channels": 2}


@pytest.fixture(scope="module")
def graph():
    return capture_ref(REF, KW, batch_size=2)


def _plan(graph, **cfg):
    config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **cfg)
    return planner.make_plan(graph, planner.Cluster.preset("local", devices=config.num_devices), config,
                             global_batch_size=4)


def test_spatial_plan_lowers_to_twin_programs_with_a_spatial_stage(graph):
    plan = _plan(graph, data=2, spatial=2, spatial_split="grid", spatial_until="pool")
    parts, programs = lower_plan(plan, graph, bucket_bytes=1024)
    assert sorted(programs) == [0, 1, 2, 3]
    assert programs[3].mesh == ((MeshAxis.PIPELINE, 1), ("data", 4), ("tensor", 1))
    assert programs[0].num_micro_batches == 1      # 4 samples / (2 per micro-batch x data 2)
    assert any(i.op == "ALLREDUCE" and i.kind == "grads" for i in programs[0].instrs)
    (stage,) = parts.stages
    sp = stage.spec.spatial
    assert (sp.degree, sp.split, sp.until, sp.batchnorm) == (2, "grid", "pool", "sync")
    assert StageSpec.from_dict(stage.spec.to_dict()) == stage.spec


def test_a_spatial_part_beyond_the_first_stage_is_refused_naming_the_layer(graph):
    plan = _plan(graph, pipeline=2, spatial=2, spatial_until="features.1", stage_boundaries=("features.1",))
    with pytest.raises(LoweringError, match="ends at layer 'features.1', beyond the first pipeline stage"):
        lower_plan(plan, graph, bucket_bytes=1024)


@pytest.mark.parametrize("change,word", [(dict(pipeline=2, schedule="gpipe", recompute="selective"), "recompute"),
                                         (dict(recompute="full"), "recompute")])
def test_spatial_plans_the_runtime_cannot_run_are_refused(graph, change, word):
    cfg = dict(spatial=2, spatial_until="features.1")
    cfg.update(change)
    plan = _plan(graph, **cfg)
    with pytest.raises(LoweringError, match=word):
        spatial_twin(plan)


def test_meshplan_codegen_writes_a_spatial_build(tmp_path, capsys):
    import json

    from planner.app.cli import main

    assert main(["codegen", REF, "--arg", "image_size=64", "--arg", "num_classes=3", "--arg", "in_channels=2",
                 "--batch", "4", "--data", "2", "--micro-batch", "2", "--spatial", "2", "--spatial-split", "grid",
                 "--spatial-until", "features.3", "-o", str(tmp_path / "b")]) == 0
    build = json.loads((tmp_path / "b" / "build.json").read_text())
    assert build["world_size"] == 4
    assert build["stages"]["0"]["spatial"] == {"degree": 2, "split": "grid", "until": "features_3_relu",
                                               "batchnorm": "sync"}
    assert main(["codegen", REF, "--arg", "image_size=64", "--batch", "4", "--spatial", "2",
                 "-o", str(tmp_path / "c")]) != 0
    assert "spatial_until" in capsys.readouterr().err
