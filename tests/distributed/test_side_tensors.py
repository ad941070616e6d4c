"""Three pipeline stages of a model whose side tensor crosses two cuts (passed along by the middle
stage), as three real processes, equal the single-process run."""

import planner
from codegen.emit import capture_ref, emit
from runtime.launch.launcher import run_local
from tests import sidenet_source
from tests.parallel_cases import SGD, assert_exact


def test_three_stage_pipeline_with_a_side_tensor(tmp_path):
    ref = sidenet_source.write(tmp_path)
    graph = capture_ref(ref, {}, batch_size=2)
    cfg = planner.ParallelConfig(pipeline=3, micro_batch_size=2, dtype="fp32", stage_boundaries=("inp", "blocks.1"))
    plan = planner.make_plan(graph, planner.Cluster.preset("local", devices=3), cfg, global_batch_size=8)
    build = emit(plan, ref, None, tmp_path / "build", graph=graph, optimizer=SGD)
    assert_exact(run_local(build.path, steps=3, timeout=60, verify=True), "sidenet p3")
