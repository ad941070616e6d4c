"""The README's "Your own model" section as a new user meets it: its example file is
examples/models/minimal.py, and its three commands (optimize, codegen, run --verify) run as written,
from a directory holding that file where the README's paths expect it, writing under out/."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

from planner.app.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SECTION = README[README.index("## Your own model\n"):README.index("\n## ", README.index("## Your own model\n") + 5)]


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", SECTION, flags=re.S)


def test_the_readme_shows_the_example_file_as_it_is():
    source = (ROOT / "examples/models/minimal.py").read_text()
    body = source.split("from __future__ import annotations\n\n", 1)[1]
    assert _blocks("python") == [body]


def test_the_readme_commands_plan_generate_and_verify_the_example(tmp_path, monkeypatch, capsys):
    (tmp_path / "examples/models").mkdir(parents=True)
    shutil.copy(ROOT / "examples/models/minimal.py", tmp_path / "examples/models/minimal.py")
    monkeypatch.chdir(tmp_path)
    (commands,) = _blocks("bash")
    lines = [ln for ln in commands.splitlines() if ln.strip()]
    assert [ln.split()[1] for ln in lines] == ["optimize", "codegen", "run"]
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] == "meshplan"
        assert main(argv[1:]) == 0, line
    out = capsys.readouterr().out
    assert "verify against the single-process reference: OK" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["examples", "out"]    # everything under out/
