"""Hostile strings for every place a user's or a model's string lands in a build, a tiny model
file that checks it receives them exactly, and checks that a generated build never runs them.

Every injection below, if it ran, would create a file named MARKER in the working directory
(Python: open(MARKER, "w"); shell: touch MARKER), so "nothing ran" is "no MARKER anywhere".
"""

from __future__ import annotations

import ast
import os
import runpy
import subprocess
import sys
from pathlib import Path

MARKER = "pwned"

# One of each way out of a string, a comment or a docstring, and into a shell command.
HOSTILE = (
    f'"""; open("{MARKER}", "w").close(); """',
    f"'''; open('{MARKER}', 'w').close(); '''",
    f"x\nopen('{MARKER}', 'w').close()\n#",
    f"\r\nopen('{MARKER}', 'w').close()",
    "back\\slash\\",
    f"# open('{MARKER}', 'w')",
    f"$(touch {MARKER})",
    f"`touch {MARKER}`",
    f"; touch {MARKER};",
    f"\u2028open('{MARKER}', 'w').close()",
)

# A directory name with the shell's ways in, spaces and both quotes (no '/': it is one name).
HOSTILE_DIR = f"""b $(touch {MARKER}) `touch {MARKER}`; "q" 'q' #"""

# A model that checks the arguments its factory, example_inputs and example_batch receive
# (EXPECTED is written into the file by repr) and raises when they differ.
MODEL_SOURCE = '''
import torch
from torch import nn

EXPECTED = {expected!r}


def _check(kw):
    if kw != EXPECTED:
        raise ValueError(f"hostile model: got arguments {{kw!r}}, expected {{EXPECTED!r}}")


def build(**kw):
    _check(kw)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def example_inputs(batch_size=2, device="cpu", **kw):
    _check(kw)
    return (torch.zeros(batch_size, 4, device=device),)


def example_batch(batch_size, seed, **kw):
    _check(kw)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch_size, 4, generator=g),), torch.randint(0, 3, (batch_size,), generator=g)
'''


def hostile_kwargs() -> dict[str, str]:
    """Every hostile string as a key and as a value."""
    return {f"k{i}{h}": h for i, h in enumerate(HOSTILE)}


def write_model(root: Path, expected: dict) -> Path:
    """The model file, in a directory and under a file name made of hostile characters."""
    d = root / HOSTILE_DIR
    d.mkdir(parents=True)
    path = d / f"tiny $(touch {MARKER}) `x`; 'q'.py"
    path.write_text(MODEL_SOURCE.format(expected=expected))
    return path


def markers(*dirs: Path) -> list[Path]:
    """Every MARKER file under `dirs` (it would be one if an injection ran)."""
    return [p for d in dirs for p in Path(d).rglob(MARKER)]


def load_rank_script(path: Path) -> dict:
    """Run a rank script's top level (its imports, stage classes, constants) but not its main."""
    return runpy.run_path(str(path), run_name="meshplan_hostile_check")


def parse_all(build: Path) -> list[ast.Module]:
    """Every generated Python file of `build`, parsed (a SyntaxError fails the caller)."""
    return [ast.parse(p.read_text(), str(p)) for p in sorted(build.glob("*.py"))]


def fake_launchers(bin_dir: Path) -> dict[str, str]:
    """Environment for running the launch scripts with stand-ins for torchrun, mpirun, srun and
    scontrol that print their arguments one per line (NUL-safe enough: no argument here holds one)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    printer = "for a in \"$@\"; do printf '%s\\0' \"$a\"; done\n"
    for name in ("torchrun", "mpirun", "srun", "scontrol"):
        tool = bin_dir / name
        tool.write_text("#!/bin/sh\n" + printer)
        tool.chmod(0o755)
    # one node's torchrun is `$PYTHON -m runtime.torchrun_local`: that prints too; the rest is this Python
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nif [ "$2" != runtime.torchrun_local ]; then exec {sys.executable} "$@"; fi\n'
                      + printer)
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MESHPLAN_BUILD", "NNODES", "MPIRUN_ARGS")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", TORCHRUN=str(bin_dir / "torchrun"),
               MPIRUN=str(bin_dir / "mpirun"), MASTER_ADDR="127.0.0.1", PYTHON=str(python))
    return env


def launch_args(script: Path, env: dict, cwd: Path, *args: str) -> list[str]:
    """The arguments a launch script hands its launcher (the stand-in's output), after checking
    the script's syntax with `bash -n`."""
    subprocess.run(["bash", "-n", str(script)], check=True, capture_output=True, timeout=60)
    proc = subprocess.run(["bash", str(script), *args], env=env, cwd=cwd, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc.stdout.decode().split("\0")[:-1]
