"""`meshplan run --verify` on torch's own nn.TransformerEncoder with its default dropout (0.1): the
dropout lives inside a module capture keeps whole, and --verify names it and says a sample-exact check
does not apply (exit status 3), instead of reporting a mismatch (examples/models/minimal.py)."""

from __future__ import annotations

from planner.app.cli import main

MINIMAL = "examples/models/minimal.py:build"


def test_verify_names_dropout_and_reports_no_mismatch(tmp_path, capsys):
    build = str(tmp_path / "build")
    assert main(["codegen", MINIMAL, "--arg", "dropout=0.1", "--batch", "4", "--data", "2", "--micro-batch", "2",
                 "--dtype", "fp32", "-o", build]) == 0
    capsys.readouterr()
    assert main(["run", build, "--steps", "1", "--verify", "--timeout", "60"]) == 3
    out, err = capsys.readouterr()
    assert "verify against the single-process reference: NOT APPLICABLE: the model draws random numbers in " \
           "training (encoder.layers.0.self_attn (attention dropout p=0.1), encoder.layers.0.dropout (dropout " \
           "p=0.1)" in out
    assert "set dropout to 0" in out and "MISMATCH" not in out + err and "differs" not in out + err
    assert "--verify does not apply to this model" in err
