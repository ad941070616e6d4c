"""Spatial plans lowered to per-rank Programs and run by the generated rank scripts on gloo
processes: after 3 steps every rank's loss and parameters equal the single-process run (fp32,
rtol 1e-4). LargeImageCNN (kernels 1, 3, 5; strides 1, 2; max pool) on 64 x 64 images, as a
2 x 2 grid over 4 ranks, as 2 horizontal strips x data 2 (and 2 tiles x data 2 under ZeRO-3,
whose shards span the data x spatial lanes), as spatial 2 x a bidirectional (GEMS)
pipeline of 2 on 4 ranks, and as the hybrid spatial 2 x pipeline 2 x data 2 on 8 ranks (the
first stage holds the tiles, the later stage runs on the gathered activations)."""

import pytest

import planner
from planner.app.commands import make_fixed_plan
from codegen.emit import capture_ref, emit
from runtime.launch.launcher import run_many
from tests.parallel_cases import SGD, assert_exact

REF = "examples/models/large_image_cnn.py:build"
KW = {"image_size": 64, "layers": [[4, 3, 1], [4, 5, 2], [4, 1, 2], [4, 3, 1]], "num_classes": 3, "in_channels": 2}
CASES = {
    "grid4": dict(spatial=4, spatial_split="grid", spatial_until="pool"),
    "strips_h2_data2": dict(data=2, spatial=2, spatial_split="strips_h", spatial_until="features.3"),
    "grid2_data2_zero3": dict(data=2, zero=3, spatial=2, spatial_split="grid", spatial_until="features.2"),
    "grid2_bidirectional2": dict(pipeline=2, bidirectional=True, spatial=2, spatial_split="grid",
                                 spatial_until="features.2"),
}


EIGHT = {
    "strips_v2_pipe2_data2": dict(data=2, pipeline=2, schedule="1f1b", spatial=2, spatial_split="strips_v",
                                  spatial_until="features.2"),
}


def _builds(root, cases, devices, global_batch):
    graph = capture_ref(REF, KW, batch_size=2)
    out = []
    for name, cfg in cases.items():
        config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **cfg)
        plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=devices), config, global_batch)
        out.append(emit(plan, REF, None, root / name, model_kwargs=KW, graph=graph, optimizer=SGD,
                        bucket_bytes=2048).path)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    builds = _builds(tmp_path_factory.mktemp("spatial_builds"), CASES, 4, 4)
    return dict(zip(CASES, run_many(builds, steps=3, backend="gloo", timeout=60, verify=True)))


@pytest.mark.timeout(400)
def test_spatial_pipeline_data_hybrid_on_eight_ranks_equals_single_process(tmp_path):
    (build,) = _builds(tmp_path, EIGHT, 8, 8)
    (res,) = run_many([build], steps=3, backend="gloo", timeout=90, verify=True)
    assert_exact(res, "spatial 2 x pipeline 2 x data 2")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CASES))
def test_spatial_build_equals_single_process(runs, name):
    assert_exact(runs[name], name)
