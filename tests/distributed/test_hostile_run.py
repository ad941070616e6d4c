"""`meshplan codegen` + `meshplan run` of a tiny model whose file, `--arg` keys and values and
output directory are hostile strings: the run trains (the model's factory and data factory
receive exactly the hostile values, or they raise) and none of the strings runs as code."""

from planner.app.cli import main
from tests.hostile_cases import HOSTILE_DIR, MARKER, markers, write_model

# Values that are no Python literal, so `--arg KEY=VALUE` passes them on as the strings they are.
ARGS = {
    "tag": f'a"""b; open("{MARKER}", "w").close()',
    f'k"""#$(touch {MARKER})': f"x'''y`touch {MARKER}`;",
    "nl": f"a\nopen('{MARKER}', 'w').close()",
    "bs": "c:\\d\\",
}


def test_codegen_and_run_with_hostile_strings(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)   # a relative `touch`/open would land here
    model = write_model(tmp_path, ARGS)
    out = tmp_path / HOSTILE_DIR / "build"
    argv = ["codegen", f"{model}:build", "--batch", "4", "--data", "2", "--micro-batch", "2", "-o", str(out)]
    for k, v in ARGS.items():
        argv += ["--arg", f"{k}={v}"]
    assert main(argv) == 0
    assert main(["run", str(out), "--steps", "1", "--timeout", "120"]) == 0
    assert "step 0: loss" in capsys.readouterr().out
    assert not markers(tmp_path)
