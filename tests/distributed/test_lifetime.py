"""The launcher's store is private and authenticated, no rank outlives `meshplan run`, and a
stopped rank is named within the heartbeat timeout (gloo, real processes)."""

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from runtime.launch.launcher import run_local
from runtime.lifetime import process_state
from tests.parallel_cases import emit_case
from tests.unit.test_jobauth_network import non_loopback_address, refused_from


@pytest.fixture(scope="module")
def mlp_d2(tmp_path_factory):
    return emit_case(tmp_path_factory.mktemp("life"), "mlp", "d2", dict(data=2))


def rank_processes(build: Path) -> dict[int, list[str]]:
    """pid -> command line of every live Python process running this build's rank script (not
    mpiexec, whose command line names the script too)."""
    found = {}
    script = str(build / "run_rank.py")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [c.decode(errors="replace") for c in cmd if c]
        if args[1:2] == [script] and process_state(int(d.name)) not in (None, "zombie"):
            found[int(d.name)] = args
    return found


def _wait_for(what, cond, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {seconds:.0f} s")


def _start_run(build: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "planner.app.cli", "run", str(build), "--steps", "1000000",
                             "--timeout", "60", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _steps_done(build: Path) -> int:
    m = build / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.is_file() else 0


@pytest.fixture()
def only_linux():
    if not Path("/proc/self").is_dir():
        pytest.skip("finding rank processes needs /proc (Linux)")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_no_rank_outlives_the_launcher(mlp_d2, how, only_linux):
    launcher = _start_run(mlp_d2)
    try:
        ranks = _wait_for("two rank processes", lambda: len(rank_processes(mlp_d2)) == 2 and rank_processes(mlp_d2),
                          120)
        _wait_for("training", lambda: _steps_done(mlp_d2) > 5, 120)
        launcher.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        t0 = time.monotonic()
        _wait_for("every rank gone", lambda: not (set(ranks) & set(rank_processes(mlp_d2))), 10)
        print(f"{how}: every rank gone {time.monotonic() - t0:.2f} s after the launcher got it")
        out = launcher.communicate(timeout=30)[0]
        if how == "sigterm":
            assert launcher.returncode == 128 + signal.SIGTERM, out
            assert "interrupted by SIGTERM; every rank was stopped" in out
        else:
            assert launcher.returncode == -signal.SIGKILL
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in rank_processes(mlp_d2):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(240)
def test_the_store_is_private_and_a_forged_failure_is_ignored(mlp_d2, only_linux):
    launcher = _start_run(mlp_d2)
    try:
        ranks = _wait_for("two rank processes", lambda: len(rank_processes(mlp_d2)) == 2 and rank_processes(mlp_d2),
                          120)
        args = next(iter(ranks.values()))
        port = int(args[args.index("--master-port") + 1])
        assert not any("SECRET" in a.upper() for a in args), "the job secret is not on the command line"
        other = non_loopback_address()
        if other is not None:
            assert refused_from(other, port), "the launcher's store answers on a non-loopback address"
        _wait_for("training", lambda: _steps_done(mlp_d2) > 5, 120)
        # Someone on this machine posts a failure without the job's secret: ignored, logged, training goes on.
        intruder = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))
        intruder.set("meshplan/meshplan/abort", "rank 0 failed: forged")
        logs = lambda: "".join(p.read_text() for p in (mlp_d2 / "run").glob("log_rank_*.txt"))  # noqa: E731
        _wait_for("the warning", lambda: "fails authentication" in logs(), 30)
        done = _steps_done(mlp_d2)
        _wait_for("more steps after the forged failure", lambda: _steps_done(mlp_d2) > done + 20, 60)
        assert launcher.poll() is None and len(rank_processes(mlp_d2)) == 2
        assert "ignored a failure message on the rendezvous store that fails authentication" in logs()
        assert "stopping" not in logs()
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=60)


@pytest.mark.timeout(240)
def test_a_stopped_rank_is_named_within_the_heartbeat_timeout(mlp_d2):
    t0 = time.monotonic()
    res = run_local(mlp_d2, steps=6, timeout=300, wall_timeout=200,
                    extra_args=["--fail-at", "1:3:2", "--fault", "sigstop", "--heartbeat-timeout", "4", "--no-trace"])
    took = time.monotonic() - t0
    print(f"a 6-step run with rank 1 stopped ended after {took:.1f} s (collective timeout 300 s, heartbeat 4 s)")
    assert res.returncode != 0
    assert took < 150, "ended by the heartbeat timeout, not the 300 s collective timeout"
    assert "meshplan rank 0: stopping because the run failed: rank 1 stopped responding: no heartbeat for" \
        in res.output or "meshplan rank 0: stopping because another rank failed: rank 1 stopped responding" \
        in res.output, res.output[-3000:]
    assert "(--heartbeat-timeout 4; its process was stopped, hangs, or died)" in res.output
    assert "rank 1 (process" in res.output and "was alive but stopped when the run failed; killed by the launcher" \
        in res.output, res.output[-3000:]
    assert res.returncodes[1] == -signal.SIGKILL
    assert not rank_processes(mlp_d2)
