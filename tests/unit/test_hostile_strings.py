"""Generated files are data, never code paths for user strings.

Hostile `--arg` keys and values, a hostile model file path, a hostile output directory and
hostile module names from the model: every generated Python file parses, its top level runs
without running any of them, the values reach the rank script exactly, the launch scripts pass
the build directory through exactly, and `simulate`, `compare` and `show` read a build without
importing the model's code.
"""

from __future__ import annotations

import ast
import json
import shutil
import sys

import pytest
import torch
from torch import nn

from codegen.emit import GRAPH_FILE, emit
from codegen.partition import partition
from codegen.pysrc import SourceError, comment_text, doc_text, import_line
from cost_models.hardware import Cluster
from cost_models.simulate import simulate
from planner.graph.capture import capture, capture_ref
from planner.app.cli import main
from planner.app.build_costs import CompareError, predicted_costs
from planner.config import ParallelConfig
from planner.graph.model import ModelGraph
from planner.fixed_plan import make_plan
from runtime.execute.optim import OptimizerSpec
from tests.hostile_cases import (HOSTILE, HOSTILE_DIR, MARKER, fake_launchers, hostile_kwargs, launch_args,
                                 load_rank_script, markers, parse_all, write_model)

SGD = OptimizerSpec(name="sgd", lr=0.1)


@pytest.mark.parametrize("text", HOSTILE)
def test_comment_and_docstring_text_cannot_end_early(text):
    src = f'"""{doc_text(text)}"""\n# {comment_text(text)}\nX = 1\n'
    tree = ast.parse(src)
    assert len(tree.body) == 2 and isinstance(tree.body[1], ast.Assign)   # the docstring and X = 1
    assert ast.get_docstring(tree, clean=False) == comment_text(text)
    assert comment_text(text) == text or ast.literal_eval(comment_text(text)) == text


def test_import_lines_hold_only_dotted_names():
    ns: dict = {}
    exec("def helper():\n    pass\n", ns)   # a module-level function whose module name we choose
    helper = ns["helper"]
    helper.__module__ = f"m; open('{MARKER}', 'w')"
    with pytest.raises(SourceError, match="not a dotted Python name"):
        import_line("helper", helper)
    with pytest.raises(SourceError, match="not a dotted Python name"):
        import_line("__import__x", f"import os; open('{MARKER}', 'w')")
    helper.__module__ = "pkg.mod"
    assert import_line("helper", helper) == "from pkg.mod import helper"
    assert import_line("__import__x", "import pkg.mod") == "import pkg.mod"


def _plan(graph, data: int = 2):
    cfg = ParallelConfig(data=data, micro_batch_size=2, dtype="fp32")
    return make_plan(graph, Cluster.preset("local", devices=data), cfg, global_batch_size=4)


@pytest.fixture(scope="module")
def hostile_build(tmp_path_factory):
    """A build of the hostile model file with hostile arguments into a hostile directory."""
    root = tmp_path_factory.mktemp("hostile")
    kwargs = hostile_kwargs()
    model = write_model(root, kwargs)
    ref = f"{model}:build"
    graph = capture_ref(ref, kwargs, batch_size=2)
    build = emit(_plan(graph), ref, None, root / HOSTILE_DIR / "out" / HOSTILE_DIR, model_kwargs=kwargs,
                 graph=graph, optimizer=SGD, checkpoint=HOSTILE[0], root=str(root / HOSTILE_DIR))
    return root, model, ref, kwargs, build


def test_rank_scripts_parse_run_and_hold_the_values_exactly(hostile_build, monkeypatch):
    root, _model, ref, kwargs, build = hostile_build
    monkeypatch.chdir(root)
    assert len(parse_all(build.path)) == build.world_size + 1          # rank scripts and run_rank.py
    for rank in range(build.world_size):
        script = build.rank_script(rank)
        text = script.read_text()
        assert "\u2028" not in text and "\r" not in text               # no line break from the user
        ns = load_rank_script(script)
        assert ns["TRAIN"]["model_ref"] == ref and ns["TRAIN"]["model_kwargs"] == kwargs
        assert ns["TRAIN"]["data_kwargs"] == kwargs and ns["TRAIN"]["checkpoint"] == HOSTILE[0]
        assert f"Model: {ref} {kwargs}" in ast.get_docstring(ast.parse(text), clean=False)
    assert json.loads((build.path / "build.json").read_text())["train"]["model_kwargs"] == kwargs
    assert not markers(root)


def test_launch_scripts_pass_the_build_directory_through(hostile_build, tmp_path):
    root, *_, build = hostile_build
    env = fake_launchers(tmp_path / "bin")
    here = str(build.path.resolve())
    for name, where in (("launch_torchrun.sh", here), ("launch_mpirun.sh", here)):
        args = launch_args(build.path / name, env, tmp_path, "--steps", HOSTILE[6])
        assert f"{where}/run_rank.py" in args and args[-1] == HOSTILE[6], (name, args)
    # srun runs `bash -c SCRIPT "$HERE" ARGS...`: the directory is an argument, never in the script
    for cwd in (tmp_path, build.path):   # sbatch runs a copy elsewhere: the path written in is used
        args = launch_args(build.path / "launch_srun.sh", env, cwd, "--steps", HOSTILE[7])
        assert args[args.index("-c") + 2] == here and args[-1] == HOSTILE[7], args
    assert not markers(root, tmp_path)


def test_model_module_names_land_only_in_comments(tmp_path, monkeypatch):
    """A module name from the model (a ModuleDict key) is in the comments and docstrings of the
    stage code; one torch.fx cannot write into code (a double quote) is refused, naming it."""
    monkeypatch.chdir(tmp_path)

    class Net(nn.Module):
        def __init__(self, key):
            super().__init__()
            self.blocks = nn.ModuleDict({key: nn.Linear(4, 8), "out": nn.Linear(8, 3)})

        def forward(self, x):
            return self.blocks["out"](torch.relu(self.blocks[self.key](x)))

    ok = f"x $(touch {MARKER}); `touch {MARKER}` # open('{MARKER}', 'w')"
    with torch.device("meta"):
        net = Net(ok)
        net.key = ok
        graph = capture(net, (torch.empty(2, 4),))
    src = "\n".join(sp.source for sp in partition(_plan(graph, data=1), graph).stages)
    assert ok in src                                              # readable in its comment
    exec(compile(ast.parse(src), "stage", "exec"), {"torch": torch})   # defines the classes: runs nothing else
    # a name torch.fx cannot write into code is refused with a ValueError naming it (by capture, or
    # by codegen/pysrc.py where capture lets it through)
    bad = f'x"""; open("{MARKER}", "w"); """'
    with pytest.raises(ValueError, match="rename it|capture"):
        with torch.device("meta"):
            net = Net(bad)
            net.key = bad
            graph = capture(net, (torch.empty(2, 4),))
        partition(_plan(graph, data=1), graph)
    assert not markers(tmp_path)


def test_readers_of_a_build_never_import_its_model(hostile_build, tmp_path, monkeypatch, capsys):
    """simulate, compare and show work on a build whose model file now writes a marker and raises at
    import: they read graph.json, plan.json and programs.json only."""
    root, model, ref, kwargs, build = hostile_build
    copy = tmp_path / "build"
    shutil.copytree(build.path, copy)
    # the graph the build carries is the one capture gives
    assert ModelGraph.load(copy / GRAPH_FILE) == capture_ref(ref, kwargs, batch_size=2)
    cluster = Cluster.preset("local", devices=build.world_size)
    _plan_, _pred, costs, progs, cl = predicted_costs(copy, cluster)
    simulate(progs, costs, cl, steps=4).save(copy / "timeline.json")   # a "measured" run for compare

    poisoned = tmp_path / "model.py"
    poisoned.write_text(f"open({str(tmp_path / MARKER)!r}, 'w').close()\nraise RuntimeError('model code ran')\n")
    train = json.loads((copy / "build.json").read_text())
    train["train"]["model_ref"] = f"{poisoned}:build"
    (copy / "build.json").write_text(json.dumps(train))
    for name in [k for k, m in sys.modules.items() if getattr(m, "__file__", None) in (str(model), str(poisoned))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", str(copy)]) == 0
    assert main(["compare", str(copy), "--no-pictures"]) == 0
    assert main(["show", str(copy / "plan.json"), "-o", str(tmp_path / "pics")]) == 0
    assert "simulated step" in capsys.readouterr().out
    assert not (tmp_path / MARKER).exists() and not markers(root, tmp_path)
    assert not [m for m in sys.modules.values() if getattr(m, "__file__", None) in (str(model), str(poisoned))]


def test_a_build_without_its_graph_is_a_clear_error(hostile_build, tmp_path, capsys):
    root, *_, build = hostile_build
    old = tmp_path / "old"
    shutil.copytree(build.path, old)
    (old / GRAPH_FILE).unlink()
    with pytest.raises(CompareError, match="meshplan codegen"):
        predicted_costs(old, Cluster.preset("local", devices=build.world_size))
    assert main(["simulate", str(old)]) == 2
    assert "graph.json is missing" in capsys.readouterr().err
    other = json.loads((build.path / GRAPH_FILE).read_text())
    other["fingerprint"] = "0" * 64
    (old / GRAPH_FILE).write_text(json.dumps(other))
    with pytest.raises(CompareError, match="another model"):
        predicted_costs(old, Cluster.preset("local", devices=build.world_size))
