"""Spatial parallelism on real processes (gloo, 4 ranks): after 3 SGD steps the loss and every
parameter equal the single-process run (fp32, rtol 1e-4), for strips and grids of 2 and 4 tiles,
kernels 1, 3 and 5, strides 1 and 2, max pooling (with and without padding), odd tile sizes,
a residual network whose spatial part ends mid-network, and spatial 2 x data 2.

Border gradients are covered: a wrong halo gradient changes the first conv's weight gradient
(tests/unit/test_spatial.py checks that removing the halo gradient breaks equality).
"""

import pytest
import torch

from tests.spatial_cases import Case, reference, run_cases

CASES = [
    Case("strips_h2_data2", 64, "strips_h", 2, 2),
    Case("strips_v2_data2", 64, "strips_v", 2, 2),
    Case("strips_h4", 64, "strips_h", 4, 1),
    Case("strips_v4", 64, "strips_v", 4, 1),
    Case("grid4", 64, "grid", 4, 1),
    Case("grid4_256px", 256, "grid", 4, 1, batch=1),
    Case("grid4_odd_60px", 60, "grid", 4, 1),
    Case("resnet_grid4_until_add_1", 64, "grid", 4, 1, until="add_1", model="resnet"),
    Case("resnet_strips_h2_data2", 64, "strips_h", 2, 2, until="add_1", model="resnet"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, 4, tmp_path_factory.mktemp("spatial"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_spatial_run_equals_single_process(results, case):
    ref_losses, ref_params = reference(case)
    for rank, got in enumerate(results[case.name]):
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-4), f"{case.name} rank {rank} losses"
        assert set(got["params"]) == set(ref_params)
        for name, want in ref_params.items():
            torch.testing.assert_close(got["params"][name], want, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{case.name} rank {rank} {name}: {m}")
