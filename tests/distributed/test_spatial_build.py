"""Spatial plans lowered to per-rank Programs and run by the generated rank scripts on 4 gloo
processes: after 3 steps every rank's loss and parameters equal the single-process run (fp32,
rtol 1e-4). LargeImageCNN (kernels 1, 3, 5; strides 1, 2; max pool) on 64 x 64 images, as a
2 x 2 grid over 4 ranks and as 2 horizontal strips x data 2."""

import pytest

import planner
from codegen.commands import make_fixed_plan
from codegen.emit import capture_ref, emit
from runtime.launcher import run_many
from tests.parallel_cases import SGD, assert_exact

REF = "examples/models/large_image_cnn.py:build"
KW = {"image_size": 64, "layers": [[4, 3, 1], [4, 5, 2], [4, 1, 2], [4, 3, 1]], "num_classes": 3, "in_channels": 2}
CASES = {
    "grid4": dict(spatial=4, spatial_split="grid", spatial_until="pool"),
    "strips_h2_data2": dict(data=2, spatial=2, spatial_split="strips_h", spatial_until="features.3"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spatial_builds")
    graph = capture_ref(REF, KW, batch_size=2)
    builds = []
    for name, cfg in CASES.items():
        config = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", **cfg)
        plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=4), config, 4)
        builds.append(emit(plan, REF, None, root / name, model_kwargs=KW, graph=graph, optimizer=SGD,
                           bucket_bytes=2048).path)
    return dict(zip(CASES, run_many(builds, steps=3, backend="gloo", timeout=60, verify=True)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CASES))
def test_spatial_build_equals_single_process(runs, name):
    assert_exact(runs[name], name)
