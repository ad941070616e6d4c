"""The smaller things a new user met (issue 31): a refused codegen leaves no output directory; a model
file without example_batch is refused by codegen, not by the run; a shape bug in forward is called one
(not "data-dependent control flow"); `meshplan show -o DIR/` names its pictures' path; the first
progress line does not count the processes' start-up as step time."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch import nn

import planner
from planner.app.cli import main
from runtime.launch.progress import StepProgress

ROOT = Path(__file__).resolve().parents[2]


def _model_file(tmp_path: Path, with_batch: bool) -> str:
    source = (ROOT / "examples/models/minimal.py").read_text()
    if not with_batch:
        source = source[:source.index("\ndef example_batch")]
    path = tmp_path / ("with_batch.py" if with_batch else "no_batch.py")
    path.write_text(source)
    return f"{path}:build"


def test_a_model_file_without_example_batch_is_refused_by_codegen_and_leaves_no_directory(tmp_path, capsys):
    out = tmp_path / "out" / "build"
    argv = ["codegen", _model_file(tmp_path, with_batch=False), "--batch", "4", "--data", "2", "--micro-batch", "2",
            "-o", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "has no 'example_batch'" in err and "Every rank reads its training batches from the model file's " \
        "example_batch(batch_size, seed, **kwargs)" in err and "--data-ref" in err
    assert not (tmp_path / "out").exists()
    # the same file with a data factory named by --data-ref: accepted
    data_ref = f"{_model_file(tmp_path, with_batch=True).rsplit(':', 1)[0]}:example_batch"
    assert main([*argv, "--data-ref", data_ref]) == 0
    assert (out / "build.json").is_file()


def test_a_plan_for_another_model_leaves_no_directory(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    mlp = "examples/models/mlp.py:build"
    assert main(["optimize", mlp, "--cluster", "dgx-h100", "--devices", "2", "--batch", "4", "--quiet",
                 "-o", str(plan)]) == 0
    assert main(["codegen", mlp, "--arg", "hidden=48", "--plan", str(plan), "-o", str(tmp_path / "other")]) == 2
    assert "the plan was made for another model" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_a_shape_bug_in_forward_is_called_one():
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(12, 4))     # 16 features out, 12 expected in
    with pytest.raises(planner.CaptureError) as e:
        planner.capture(model, torch.zeros(2, 8))
    text = str(e.value)
    assert "node '_1' (torch.nn.Linear) in 1 failed on inputs [_0: (2, 16) float32]" in text
    assert "forward() fails on these example inputs" in text and "control flow" not in text


def test_show_into_a_directory_names_the_pictures_path(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["optimize", "examples/models/mlp.py:build", "--cluster", "dgx-h100", "--devices", "2", "--batch",
                 "4", "--quiet", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["show", str(plan), "-o", f"{tmp_path / 'pics'}/"]) == 0
    assert f"pictures ({tmp_path / 'pics'}/*.png|svg) and {tmp_path / 'pics'}/report.html" in capsys.readouterr().out
    assert (tmp_path / "pics" / "mesh.png").is_file()


def test_the_first_progress_line_leaves_the_start_up_out():
    now = [100.0]
    out = io.StringIO()
    p = StepProgress(0, 4, out, interval_s=0.0, clock=lambda: now[0])
    now[0] += 30.0                                       # the processes start; the first step takes 0.1 s
    p.update({"step": 0, "loss": 1.0, "seconds": 0.1})
    assert out.getvalue().startswith("step 0 (1/4, 25%)  loss 1.0000  0:30 elapsed, 0.100 s/step, ETA 0:00")
    quiet = io.StringIO()
    StepProgress(0, 4, quiet, interval_s=0.0, clock=lambda: now[0]).update({"step": 0, "loss": 1.0})
    assert "ETA -" in quiet.getvalue()                   # no step time known yet: no rate, not the start-up's
