"""Held-out evaluation in real runs (gloo): after every 2nd of 4 steps, 2 held-out batches forward only over
data 2 x tensor 2 (vocabulary-parallel logits), data 2 x pipeline 2 and ZeRO-3; `meshplan run --verify`
passes and compares the evaluations with the single-process reference's, and every rank reports the
reference's accuracy exactly."""

import contextlib
import io
import json
import math

import pytest

from planner.app.cli import main
from runtime.execute.evaluation import EvalSpec, read_run_evals
from runtime.program import Program
from runtime.reference import reference_run
from runtime.spec import TrainSpec
from tests.parallel_cases import emit_case

EVAL = EvalSpec(every=2, batches=2)
CASES = {
    "d2t2": (dict(data=2, tensor=2), EVAL),
    "d2p2": (dict(data=2, pipeline=2), EVAL),
    "d2_zero3": (dict(data=2, zero=3), None),   # the build does not evaluate: `meshplan run --eval-every` asks
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluation")
    out = {}
    for name, (cfg, evaluation) in CASES.items():
        build = emit_case(root, "gpt", name, cfg, evaluation=evaluation)
        flags = [] if evaluation is not None else ["--eval-every", "2", "--eval-batches", "2"]
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(["run", str(build), "--steps", "4", "--timeout", "60", "--verify", *flags])
        out[name] = (build, code, stdout.getvalue() + stderr.getvalue())
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_evaluation_equals_the_single_process_reference(runs, name):
    build, code, output = runs[name]
    assert code == 0, f"{name}:\n{output[-4000:]}"
    assert "verify against the single-process reference: OK" in output and "2 evaluation(s) within" in output
    assert "step 1: eval loss" in output and "step 3: eval loss" in output
    setting, evals = read_run_evals(build / "run")
    assert setting == EVAL and [e.step for e in evals] == [1, 3]
    assert all(e.elements == EVAL.batches * 8 * 16 for e in evals)   # 2 global batches of 8 rows x 16 tokens
    # every rank holds the same numbers
    world = len(json.loads((build / "programs.json").read_text()))
    for r in range(1, world):
        assert json.loads((build / "run" / f"rank_{r:04d}.json").read_text())["evals"] == \
            [e.to_dict() for e in evals], f"rank {r}"
    spec = TrainSpec.from_dict(json.loads((build / "build.json").read_text())["train"])
    mb = Program.from_dict(json.loads((build / "programs.json").read_text())["0"]).micro_batch_size
    ref = reference_run(spec, 4, micro_batch_size=mb, evaluation=EVAL).evals
    assert [e.accuracy for e in evals] == [e.accuracy for e in ref]
    assert all(math.isclose(a.loss, b.loss, rel_tol=1e-5) for a, b in zip(evals, ref)), (evals, ref)
