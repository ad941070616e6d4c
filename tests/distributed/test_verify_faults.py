"""`--verify` catches real bugs: each run below breaks one piece of the parallel arithmetic on purpose
(rank option --sabotage, runtime/verify/sabotage.py) while every rank still communicates as its peers
expect, and must fail verification; the same build untouched must pass. Also the command-line round
trip optimize -> codegen --plan -> run --verify for a Hugging Face model, and its refusal of a plan
made for another model.
"""

import shutil

import pytest

from planner.app.cli import main
from runtime.launch.launcher import read_build, run_many
from tests.real_models import CONFIGS, HF, assert_verified, emit_fixed

# (build, sabotage, a problem --verify must name)
SABOTAGED = [
    ("tied", "drop-bucket", "the gradient of"),
    ("tied", "skip-tied-sum", "the gradient of transformer.wte.weight"),
    ("halo", "drop-halo-grad", "the gradient of features.0"),
]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    return {
        "tied": emit_fixed(root, HF, {"arch": "gpt2"}, "gpt2_d2p2", CONFIGS["d2p2"]),
        "halo": emit_fixed(root, "examples/models/large_image_cnn.py:build", {"image_size": 32}, "cnn_spatial2",
                           dict(spatial=2, spatial_until="pool", spatial_split="strips_h"), batch=4),
    }


@pytest.fixture(scope="module")
def runs(builds):
    """(build, sabotage or None) -> its 2-step run with --verify. Each sabotaged run uses a copy of its build
    (a run's outputs are its build's), and the runs of one world size share one launch."""
    jobs = {(name, None): (b, []) for name, b in builds.items()}
    for name, what, _bad in SABOTAGED:
        copy = builds[name].with_name(f"{builds[name].name}_{what}")
        shutil.copytree(builds[name], copy)
        jobs[(name, what)] = (copy, ["--sabotage", what])
    results = {}
    for world in sorted({read_build(b)["world_size"] for b, _a in jobs.values()}):
        keys = [k for k, (b, _a) in jobs.items() if read_build(b)["world_size"] == world]
        res = run_many([jobs[k][0] for k in keys], steps=2, timeout=60, verify=True,
                       build_args=[jobs[k][1] for k in keys])
        results.update(zip(keys, res))
    return results


@pytest.mark.parametrize("build,sabotage,bad", SABOTAGED)
def test_verify_fails_a_run_that_loses_gradients(runs, sabotage, build, bad):
    res = runs[(build, sabotage)]
    assert res.returncode == 0, res.output[-3000:]
    cmp = res.comparison
    assert not cmp.ok, f"--verify missed {sabotage}: {cmp.summary()}"
    assert any(bad in p for p in cmp.problems), cmp.summary()


@pytest.mark.parametrize("build", ["tied", "halo"])
def test_the_same_builds_untouched_pass(runs, build):
    assert_verified(runs[(build, None)], build)


def test_cli_optimize_codegen_run_verify_for_a_hugging_face_model(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    # optimize captures at batch 1, codegen at the micro-batch: the plan binds to the model, not the batch
    assert main(["optimize", HF, "--arg", "arch=llama", "--cluster", "local", "--devices", "2", "--batch", "8",
                 "--quiet", "-o", str(plan)]) == 0
    assert main(["codegen", HF, "--arg", "arch=llama", "--plan", str(plan), "-o", str(tmp_path / "build")]) == 0
    assert main(["run", str(tmp_path / "build"), "--steps", "3", "--verify", "--timeout", "60"]) == 0
    assert "single-process reference: OK" in capsys.readouterr().out
    # a plan made for another model is refused, in one line naming the mismatch
    assert main(["codegen", HF, "--arg", "arch=qwen2", "--plan", str(plan), "-o", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "the plan was made for another model" in err and "Traceback" not in err
