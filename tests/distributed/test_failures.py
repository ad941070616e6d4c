"""Bad input and failing ranks: a clear error on every rank, and no rank left hanging."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from codegen.emit import PlanMismatchError, emit
from runtime.launcher import free_port, run_local
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
