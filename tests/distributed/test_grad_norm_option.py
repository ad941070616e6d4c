"""`meshplan codegen --no-grad-norm`: the ranks compute the global gradient norm only where the step needs it.

Without clipping or loss scaling such a run reports no norm (metrics.jsonl's grad_norm null, the rank
records' grad_norms null) and trains exactly as the build that reports it (the norm changes nothing it
does not clip); `--verify` still checks the norm (its recording run computes it); a build that also
clips computes it every step. Real processes on gloo, data 2 x tensor 2 (the norm's pieces span both).
"""

import json
from pathlib import Path

import pytest

from planner.app.cli import main
from runtime.launch.launcher import run_many
from tests.parallel_cases import assert_exact

pytestmark = pytest.mark.timeout(600)
STEPS = 3


def _codegen(out: Path, *flags: str) -> Path:
    argv = ["codegen", "examples/models/gpt.py:build", "--arg", "preset=tiny", "--batch", "8", "--micro-batch", "2",
            "--data", "2", "--tensor", "2", "--optimizer", "adamw", "--lr", "0.01", *flags, "-o", str(out)]
    assert main(argv) == 0
    return out


def _records(build: Path) -> tuple[list, list]:
    lines = [json.loads(x) for x in (build / "metrics.jsonl").read_text().splitlines()]
    rec = json.loads((build / "run" / "rank_0000.json").read_text())
    return [x["grad_norm"] for x in lines], rec["grad_norms"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grad_norm")
    builds = {"reported": _codegen(root / "reported"), "off": _codegen(root / "off", "--no-grad-norm"),
              "off_clipped": _codegen(root / "off_clipped", "--no-grad-norm", "--clip-grad", "1e-3")}
    plain = dict(zip(builds, run_many(list(builds.values()), steps=STEPS, timeout=120)))
    # its own build directory: a run rewrites its build's metrics and records
    verified = run_many([_codegen(root / "off_verified", "--no-grad-norm")], steps=STEPS, timeout=120, verify=True)[0]
    return builds, plain, verified


def test_no_grad_norm_reports_none_and_trains_alike(runs):
    builds, plain, _ = runs
    for name, res in plain.items():
        assert res.returncode == 0, f"{name}\n{res.output[-3000:]}"
    assert json.loads((builds["off"] / "build.json").read_text())["train"]["grad_norm"] is False
    assert "grad_norm" not in json.loads((builds["reported"] / "build.json").read_text())["train"]
    metrics, records = _records(builds["off"])
    assert metrics == [None] * STEPS and records == [None] * STEPS
    metrics, records = _records(builds["reported"])
    assert all(n is not None and n > 0 for n in metrics) and records == pytest.approx(metrics)
    assert plain["off"].losses == plain["reported"].losses   # the norm changed nothing it does not clip


def test_no_grad_norm_still_computes_what_clipping_needs(runs):
    builds, plain, _ = runs
    metrics, _ = _records(builds["off_clipped"])
    assert all(n is not None and n > 1e-3 for n in metrics), metrics
    assert plain["off_clipped"].losses[0][1:] != plain["off"].losses[0][1:]   # clipped from step 0 on


def test_verify_checks_the_norm_of_a_build_that_reports_none(runs):
    _, _, verified = runs
    assert_exact(verified, "--no-grad-norm --verify")
    assert verified.comparison.norms_compared == STEPS
