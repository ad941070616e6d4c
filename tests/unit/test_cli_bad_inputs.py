"""A fixed sample of benchmarks/fuzz_cli.py's bad inputs, run in-process through planner.app.cli.main:
each ends as a clear error (exit 2, the last stderr line says "error:", no traceback), before any
model is trained or measured. The whole fuzz (every case in a subprocess) is the benchmark."""

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

from planner.app.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fuzz_cli  # noqa: E402

# Names of fuzz_cli cases: one or more per verb and per kind of fault, all quick in-process
# (no case here starts a rank process, a calibration or a search longer than a tiny one).
SAMPLE = (
    "capture --batch 0", "capture --batch -1", "capture --batch huge", "capture --max-layers -1",
    "capture ref syntax error", "capture ref missing import", "capture ref factory raises", "capture ref sys.exit",
    "capture ref not callable", "capture ref inputs raise", "capture ref returns int", "capture ref missing module",
    "capture unknown --arg", "capture -o a directory", "capture -o under a file", "capture -o unwritable",
    "optimize --batch 0", "optimize --batch huge", "optimize --devices 0", "optimize --nodes huge",
    "optimize --constraint tensor=two", "optimize --constraint tensor=0", "optimize --constraint pipeline=1.5",
    "optimize --constraint max_memory_fraction=abc", "optimize -o under a file",
    "show plan swapped", "show plan micro3", "show plan batch1e30", "show plan world0", "show plan product",
    "show plan gap", "show -o under a file",
    "cluster --nodes huge", "cluster --devices 0", "cluster -o a directory",
    "codegen --batch 0", "codegen --batch 100000 --data 100000", "codegen --data 0", "codegen --micro-batch 3",
    "codegen --data 8", "codegen --bucket-mb nan", "codegen --lr -1", "codegen plan gap", "codegen plan swapped",
    "codegen ref sys.exit", "codegen unknown --arg", "codegen -o a directory",
    "run --steps 0", "run --timeout 0", "run --timeout -1", "run --timeout nan", "run --save-every 0",
    "run --rtol -1", "run world size 0", "run --checkpoint-dir under a file", "run --checkpoint-dir onto a file",
    "calibrate --timeout 0", "calibrate --ranks 0", "calibrate --ranks 100000", "calibrate --out a directory",
    "calibrate --out under a file", "calibrate --out unwritable",
    "run --resume missing", "simulate world size 0", "compare world size 0",
    # nothing overwritten unasked
    "capture -o existing file", "optimize -o existing file", "show -o existing report", "cluster -o existing file",
    "calibrate --out existing file", "codegen -o a directory of other files", "checkpoint convert -o existing file",
    "checkpoint convert -o into a torch checkpoint",
    # checked before launch, not at step 0
    "codegen --no-loss-scale fp32", "codegen --warmup-steps huge", "codegen --decay-steps huge",
    "codegen --init checkpoint not torch", "codegen --dataset samples longer than positions",
    "codegen --dataset ids beyond vocabulary", "run --tensorboard onto a file", "run --tensorboard under a file",
    "run --tensorboard unwritable",
    # damaged builds, named with "make the build again"
    "run truncated build.json", "compare truncated build.json", "compare non-UTF-8 programs.json",
    "compare damaged plan.json", "simulate truncated build.json", "simulate non-UTF-8 programs.json",
    "simulate damaged plan.json",
    # checkpoints that would run code or were changed: refused, naming the file; the marker never appears
    "run --resume crafted .metadata", "run --resume changed .distcp", "run --resume record not JSON",
    "run --resume crafted rank file", "run --resume manifest not JSON", "checkpoint show crafted .metadata",
    "checkpoint convert crafted .metadata", "checkpoint show changed .distcp", "checkpoint show record not JSON",
    "checkpoint show manifest not JSON",
)


def run_main(argv) -> tuple[int, str]:
    """(exit status, stderr) of planner.app.cli.main; argparse's exit counts as its status."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code
    return rc, err.getvalue()


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    def cli(argv):
        return run_main(argv)[0]

    return fuzz_cli.make_fixtures(tmp_path_factory.mktemp("fuzz_cli"), cli)


def test_sample_names_exist(fixtures):
    names = {c.name for c in fuzz_cli.cases(fixtures)}
    assert not set(SAMPLE) - names
    assert len({c.verb for c in fuzz_cli.cases(fixtures)}) == 10  # every verb is fuzzed


@pytest.mark.parametrize("name", SAMPLE)
def test_bad_input_is_a_clear_error(fixtures, name):
    case = next(c for c in fuzz_cli.cases(fixtures) if c.name == name)
    before = {p: fuzz_cli._digest(p) for p in case.unchanged}
    assert all(v is not None for v in before.values()), "the files it must leave alone exist"
    rc, err = run_main(case.argv)
    assert fuzz_cli.classify(case, rc, err) == "clear error", (rc, err)
    assert fuzz_cli.side_effects(case, before) is None
    if "damaged" in name or "build.json" in name or "programs.json" in name:
        assert "make the build again" in err, err


def test_ctrl_c_in_any_verb_is_one_line_and_status_130(fixtures, capsys):
    ref = f"{fixtures.models}/interrupts.py:build"  # a factory that raises KeyboardInterrupt
    for argv in (["capture", ref], ["codegen", ref, "--batch", "2", "-o", str(fixtures.tmp / "b_int")]):
        assert main(argv) == 130
        err = capsys.readouterr().err
        assert err.strip().endswith("interrupted") and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_factory_errors_name_file_and_line(fixtures, capsys):
    m = fixtures.models
    for name, needle in (("syntax.py", "line 2"), ("raises.py", "line 5: the factory broke"),
                         ("exits.py", "sys.exit(3)"), ("missing_import.py", "'no_such_module_meshplan'")):
        assert main(["capture", f"{m}/{name}:build"]) == 2
        err = capsys.readouterr().err
        assert name in err and needle in err, err
    assert main(["capture", "examples/models/mlp.py:build", "--arg", "nosuch=1"]) == 2
    assert "accepts in_features, hidden, num_layers, out_features" in capsys.readouterr().err


def test_output_paths_checked_before_work(fixtures, monkeypatch, capsys):
    import planner.app.calibrate_run as cr

    def must_not_run(*a, **k):
        raise AssertionError("calibration started before the output path was checked")

    monkeypatch.setattr(cr, "calibrate_machine", must_not_run)
    assert main(["calibrate", "--out", str(fixtures.a_file / "c.yaml")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    # a missing directory is created, as optimize's -o always did
    out = fixtures.tmp / "new" / "dir" / "c.json"
    assert main(["cluster", "local", "-o", str(out)]) == 0 and out.is_file()


def test_valid_plan_still_shows_and_layers_are_checked(fixtures):
    from planner import Plan, PlanFileError

    plan = Plan.load(fixtures.plan)
    names = [n for st in plan.stages for n in st.layers]
    plan.check_layers(names)
    with pytest.raises(PlanFileError, match=r"holds .* where the model has"):
        plan.check_layers(names[1:] + names[:1])
    doc = json.loads(fixtures.plan.read_text())
    assert doc["global_batch_size"] == 4
