"""The meshplan command line: capture and cluster verbs, and their error handling."""

import subprocess
import sys

import pytest

from planner.app.cli import main


def test_capture_prints_summary_and_writes_json(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert main(["capture", "examples/models/gpt.py:build", "--arg", "preset=tiny", "--batch", "2",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "blocks.1" in text and "parameters:" in text
    from planner.graph.model import ModelGraph
    assert ModelGraph.load(out).batch_size == 2


def test_cluster_preset_and_file_round_trip(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    assert main(["cluster", "summit", "--nodes", "2", "-o", str(path)]) == 0
    assert main(["cluster", str(path)]) == 0
    text = capsys.readouterr().out
    assert text.count("2 node(s) x 6") == 2


@pytest.mark.parametrize("argv,needle", [
    (["capture", "examples/models/nope.py:build"], "does not exist"),
    (["capture", "examples/models/gpt.py:nope"], "has no 'nope'"),
    (["capture", "examples/models/gpt.py"], "no ':NAME' part"),
    (["capture", "examples/models/gpt.py:build", "--arg", "oops"], "KEY=VALUE"),
    (["capture", "examples/models/gpt.py:build", "--arg", "hidden=30", "--arg", "num_heads=4"], "hidden=30"),
    (["cluster", "nosuch"], "neither a preset"),
    (["cluster", "dgx-h100", "--devices", "9"], "9"),
])
def test_user_errors_are_one_line_and_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "planner.app.cli", "capture", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "examples:" in out and "MODEL_REF" in out


def test_optimize_writes_a_plan(tmp_path, capsys):
    from planner import Plan

    out = tmp_path / "plan.json"
    assert main(["optimize", "examples/models/gpt.py:build", "--arg", "preset=tiny", "--cluster", "dgx-a100-80gb",
                 "--batch", "16", "--quiet", "--constraint", "max_memory_fraction=0.9", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mesh:" in text and "chosen:" in text
    assert Plan.load(out).cluster.num_devices == 8
    assert main(["optimize", "examples/models/gpt.py:build", "--arg", "preset=tiny", "--cluster", "dgx-a100-80gb",
                 "--batch", "16", "--constraint", "tensr=2", "-o", str(out), "--force"]) == 2
    assert "did you mean 'tensor'" in capsys.readouterr().err


def test_show_draws_a_plan(tmp_path, capsys):
    plan = tmp_path / "p" / "plan.json"
    assert main(["optimize", "examples/models/gpt.py:build", "--arg", "preset=tiny", "--cluster", "dgx-a100-80gb",
                 "--batch", "16", "--quiet", "-o", str(plan)]) == 0
    assert main(["show", str(plan)]) == 0
    assert (tmp_path / "p" / "plan_mesh.png").stat().st_size > 1000
    assert "<svg" in (tmp_path / "p" / "plan_report.html").read_text()
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
