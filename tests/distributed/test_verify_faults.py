"""`--verify` catches real bugs: each run below breaks one piece of the parallel arithmetic on purpose
(rank option --sabotage, runtime/sabotage.py) while every rank still communicates as its peers
expect, and must fail verification; the same build untouched must pass. Also the command-line round
trip optimize -> codegen --plan -> run --verify for a Hugging Face model, and its refusal of a plan
made for another model.
"""

import pytest

from planner.app.cli import main
from runtime.launcher import run_many
from tests.real_models import CONFIGS, HF, assert_verified, emit_fixed


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    return {
        "tied": emit_fixed(root, HF, {"arch": "gpt2"}, "gpt2_d2p2", CONFIGS["d2p2"]),
        "halo": emit_fixed(root, "examples/models/large_image_cnn.py:build", {"image_size": 32}, "cnn_spatial2",
                           dict(spatial=2, spatial_until="pool", spatial_split="strips_h"), batch=4),
    }


@pytest.mark.parametrize("build,sabotage,bad", [
    ("tied", "drop-bucket", "the gradient of"),
    ("tied", "skip-tied-sum", "the gradient of transformer.wte.weight"),
    ("halo", "drop-halo-grad", "the gradient of features.0"),
])
def test_verify_fails_a_run_that_loses_gradients(builds, sabotage, build, bad):
    res, = run_many([builds[build]], steps=2, timeout=60, verify=True, extra_args=["--sabotage", sabotage])
    assert res.returncode == 0, res.output[-3000:]
    cmp = res.comparison
    assert not cmp.ok, f"--verify missed {sabotage}: {cmp.summary()}"
    assert any(bad in p for p in cmp.problems), cmp.summary()


@pytest.mark.parametrize("build", ["tied", "halo"])
def test_the_same_builds_untouched_pass(builds, build):
    res, = run_many([builds[build]], steps=2, timeout=60, verify=True)
    assert_verified(res, build)


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
