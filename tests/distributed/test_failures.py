"""Bad input and failing ranks: a clear error on every rank, and no rank left hanging."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from codegen.emit import PlanMismatchError, emit
from runtime.launch.launcher import free_port, run_local, stop_reasons
from tests.parallel_cases import MODELS, emit_case, plan_for


def _every_rank_says(out: str, world: int, needle: str) -> None:
    for r in range(world):
        assert any(line.startswith(f"[rank {r}]") and needle in line for line in out.splitlines()), \
            f"rank {r} did not report {needle!r}:\n{out[-3000:]}"


@pytest.fixture(scope="module")
def mlp_p2(tmp_path_factory):
    return emit_case(tmp_path_factory.mktemp("fail"), "mlp", "d2", dict(data=2))


def test_world_size_that_does_not_match_the_plan(mlp_p2):
    t0 = time.monotonic()
    res = run_local(mlp_p2, steps=1, world_size=3, timeout=20)
    assert res.returncode == 2
    _every_rank_says(res.output, 3, "the plan needs 2 processes, but 3 were started")
    assert time.monotonic() - t0 < 60


def test_plan_made_for_another_model_is_refused_by_codegen(tmp_path):
    plan = plan_for("gpt", data=2)
    with pytest.raises(PlanMismatchError, match="another model"):
        emit(plan, "examples/models/mlp.py:build", None, tmp_path / "b")


def _own_model_file(tmp_path):
    src = tmp_path / "models" / "mymlp.py"
    src.parent.mkdir()
    shutil.copy("examples/models/mlp.py", src)
    return src


def test_model_changed_after_codegen_is_refused_on_every_rank(tmp_path):
    src = _own_model_file(tmp_path)
    ref = f"{src}:build"
    from codegen.emit import capture_ref
    graph = capture_ref(ref, {}, batch_size=2)
    plan = plan_for("mlp", data=2)  # same structure as examples/models/mlp.py
    build = emit(plan, ref, None, tmp_path / "b", graph=graph).path
    src.write_text(src.read_text().replace("hidden: int = 32", "hidden: int = 48"))
    res = run_local(build, steps=1, timeout=20)
    assert res.returncode == 2
    _every_rank_says(res.output, 2, "the plan was made for another model")
    assert "net.0.bias is [48], the plan has [32]" in res.output


def test_missing_model_factory_on_every_rank(tmp_path):
    src = _own_model_file(tmp_path)
    build = emit(plan_for("mlp", data=2), f"{src}:build", None, tmp_path / "b",
                 graph=__import__("codegen.emit", fromlist=["capture_ref"]).capture_ref(f"{src}:build", {}, 2)).path
    src.unlink()
    res = run_local(build, steps=1, timeout=20)
    assert res.returncode == 2
    _every_rank_says(res.output, 2, "model factory")
    _every_rank_says(res.output, 2, "does not exist")


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_rank_makes_the_others_exit_with_its_reason(mlp_p2, failing):
    t0 = time.monotonic()
    res = run_local(mlp_p2, steps=3, timeout=30, extra_args=["--fail-at", f"{failing}:1:4"], wall_timeout=120)
    assert res.returncode == 1
    other = 1 - failing
    assert f"meshplan rank {failing}: error: rank {failing} failed at step 1, instruction 4" in res.output
    assert f"meshplan rank {other}: stopping because another rank failed: rank {failing} failed at step 1" \
        in res.output, res.output[-3000:]
    assert time.monotonic() - t0 < 60


def test_a_rank_that_never_arrives_times_out_instead_of_hanging(mlp_p2):
    """Only rank 0 starts: its rendezvous gives up after --timeout with a clear error."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(mlp_p2 / "run_rank.py"), "--steps", "1", "--timeout", "3"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "meshplan rank 0" in proc.stderr and ("timed out" in proc.stderr.lower() or "timeout" in proc.stderr.lower()), \
        proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60


def test_unknown_models_are_listed():
    assert set(MODELS) == {"mlp", "gpt", "resnet"}


# ---- a rank that dies or stops responding mid-step ------------------------------------------------

def _fault_time(out: str, rank: int) -> float:
    m = re.search(rf"meshplan rank {rank}: injecting fault: .* at unix time ([0-9.]+)", out)
    assert m, f"rank {rank} did not announce its fault:\n{out[-3000:]}"
    return float(m.group(1))


def _no_processes_left(build) -> None:
    """No rank process of `build` is still running, and no child of this test is a zombie."""
    me, script = str(os.getpid()), f"{build}/run_rank.py"
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            stat = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        assert script not in cmd, f"process {d} of the build is still running: {cmd}"
        assert not (ppid == me and state == "Z"), f"zombie child {d}: {cmd}"


TIMEOUT = 12.0


def _run_with_fault(build, rank: int, at: str, fault: str):
    """4 steps with `fault` injected on `rank` at STEP:INSTR `at`: (result, unix time of the fault)."""
    res = run_local(build, steps=4, timeout=TIMEOUT, extra_args=["--fail-at", f"{rank}:{at}", "--fault", fault],
                    wall_timeout=150)
    assert res.returncode != 0
    return res, _fault_time(res.output, rank)


@pytest.mark.timeout(180)
def test_a_rank_killed_with_sigkill_mid_step(mlp_p2):
    res, killed = _run_with_fault(mlp_p2, 1, "2:4", "sigkill")
    assert res.returncodes[1] == -signal.SIGKILL
    assert res.returncodes[0] == 1, "rank 0 exits by itself, with its reason (the launcher did not kill it)"
    waited = res.exit_times[0] - killed
    print(f"rank 0 exited {waited:.2f} s after rank 1 was killed (--timeout {TIMEOUT:.0f} s)")
    assert waited < TIMEOUT + 10
    assert "meshplan rank 0: stopping because another rank failed: rank 1 stopped responding (no heartbeat" in res.output, res.output[-3000:]
    assert "(rank 0 was at step 2, instruction" in res.output
    assert "rank 1 was killed by signal SIGKILL" in res.output
    # meshplan run's failure summary: why each rank stopped, and how far the run got (not a stale heartbeat)
    reasons = stop_reasons(mlp_p2, res)
    assert reasons[0].startswith("rank 0 exited with status 1: meshplan rank 0: stopping because another rank failed")
    assert reasons[1:] == ["rank 1 was killed by signal SIGKILL", "the run's last finished step: step 1 (metrics.jsonl)"]
    _no_processes_left(mlp_p2)


@pytest.mark.timeout(240)
def test_sigkill_on_four_ranks_stops_the_ranks_that_never_talk_to_it(tmp_path):
    """data 2 x pipeline 2: rank 3 dies in a backward; rank 0 shares no group with it."""
    build = emit_case(tmp_path, "gpt", "d2p2", dict(data=2, pipeline=2))
    res, killed = _run_with_fault(build, 3, "2:5", "sigkill")
    assert res.returncodes == {0: 1, 1: 1, 2: 1, 3: -signal.SIGKILL}
    waited = max(t for r, t in res.exit_times.items() if r != 3) - killed
    print(f"ranks 0-2 exited {waited:.2f} s after rank 3 was killed (--timeout {TIMEOUT:.0f} s)")
    assert waited < TIMEOUT + 10
    _every_rank_says(res.output, 3, "stopping because another rank failed: rank 3 stopped responding (no heartbeat")
    _no_processes_left(build)


@pytest.mark.timeout(180)
def test_a_rank_that_stops_responding(mlp_p2):
    res, hung = _run_with_fault(mlp_p2, 0, "2:3", "hang")
    assert res.returncodes == {0: 1, 1: 1}, "both ranks exit by themselves (the hung one through its watchdog)"
    waited = max(res.exit_times.values()) - hung
    print(f"both ranks exited {waited:.2f} s after rank 0 stopped responding (--timeout {TIMEOUT:.0f} s)")
    assert waited < TIMEOUT + 10
    assert "meshplan rank 1: stopping because another rank failed: rank 0 stopped responding (alive, but making " \
        "no progress) at step 2, instruction 3" in res.output, res.output[-3000:]
    assert "meshplan rank 0: stopping because the run failed" in res.output and "ended by its watchdog" in res.output
    _no_processes_left(mlp_p2)
