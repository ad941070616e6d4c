"""Throw bad inputs at every `meshplan` verb and classify what each one does.

    python benchmarks/fuzz_cli.py [--limit 60] [--only capture,run] [--keep DIR]

Every case runs `python -m planner.app.cli ...` in a subprocess of its own (PYTHONPATH: this
checkout, or the one in $PYTHONPATH when set) under a wall-clock limit (seconds), and
ends as one of:

    clear error   exit 2 (exit 130 "interrupted" after Ctrl-C), no traceback, the last line on
                  stderr says "error:" (argparse's usage line before it is fine)
    success       exit 0 where the input is allowed (a value at a documented cap)
    SILENT WRONG  exit 0 for an input that cannot be right (world size 0, a batch the
                  micro-batch does not divide, ...)
    TRACEBACK     a Python traceback on stderr
    HANG          still running at the limit (killed)
    UNCLEAR       any other exit: non-zero without a traceback and without a one-line error

The inputs: numeric options at 0, -1, huge and non-numbers; output paths that are missing,
unwritable, a directory or under a file; model references broken in every way (syntax
error, missing import, a factory that raises, calls sys.exit, is not callable, gets an
unknown keyword, example_inputs that raises); hand-edited plans and builds; Ctrl-C
during a run. `cases()` is shared with tests/unit/test_cli_bad_inputs.py, which runs a
sample of them in-process. Exits non-zero unless every case ends as a clear error or an
allowed success.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]

# Broken model files: name -> source. Each defines what capture needs except for its one fault.
_TINY = ("import torch\n"
         "def example_inputs(batch_size=1, device='cpu', **kw):\n"
         "    return (torch.empty(batch_size, 4, device=device),)\n")
BROKEN_MODELS = {
    "syntax.py": "import torch\ndef build(:\n    pass\n",
    "missing_import.py": ("import no_such_module_meshplan\n" + _TINY
                          + "def build():\n    return torch.nn.Linear(4, 2)\n"),
    "raises.py": _TINY + "def build():\n    raise RuntimeError('the factory broke')\n",
    "exits.py": "import sys\n" + _TINY + "def build():\n    sys.exit(3)\n",
    "not_callable.py": _TINY + "build = 3\n",
    "inputs_raise.py": ("import torch\ndef example_inputs(batch_size=1, device='cpu'):\n"
                        "    raise KeyError('no inputs')\ndef build():\n    return torch.nn.Linear(4, 2)\n"),
    "returns_int.py": _TINY + "def build():\n    return 7\n",
    "interrupts.py": _TINY + "def build():\n    raise KeyboardInterrupt\n",
}
HUGE = str(10 ** 18)
# An output path whose directories do not exist yet: every verb creates them (as optimize's -o
# always did), so these cases end in success; the other bad paths must be refused up front.
CREATED = "missing dir"
OUTCOMES = ("clear error", "success", "SILENT WRONG", "TRACEBACK", "HANG", "UNCLEAR")


@dataclasses.dataclass(frozen=True)
class Case:
    """One command line. `must_fail`: a bad input (exit 0 is a silent wrong result);
    `sigint_after`: seconds after which Ctrl-C reaches the command's process group."""

    name: str
    argv: tuple[str, ...]
    must_fail: bool = True
    sigint_after: float | None = None

    @property
    def verb(self) -> str:
        return self.argv[0]


@dataclasses.dataclass(frozen=True)
class Fixtures:
    """Paths the cases point at (all under `tmp`)."""

    tmp: Path
    models: Path          # the broken model files
    plan: Path            # a valid 2-device plan of gpt tiny (batch 4)
    build: Path           # a valid 1-rank build of the mlp (batch 4)
    a_file: Path          # a plain file (a path under it cannot be created)
    a_dir: Path           # an existing directory


def _write_json(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


def make_fixtures(tmp: Path, cli: Callable[[Sequence[str]], int]) -> Fixtures:
    """Write the broken models, a valid plan and build (through `cli`, argv -> exit status)
    and their hand-edited copies under `tmp`."""
    models = tmp / "models"
    models.mkdir(parents=True, exist_ok=True)
    for name, src in BROKEN_MODELS.items():
        (models / name).write_text(src)
    plan, build = tmp / "plan.json", tmp / "build"
    if not plan.exists() and cli(["optimize", "examples/models/gpt.py:build", "--arg", "preset=tiny",
                                  "--cluster", "local", "--devices", "2", "--batch", "4", "--quiet",
                                  "-o", str(plan)]) != 0:
        raise RuntimeError("fuzz_cli: could not make the fixture plan")
    if not (build / "build.json").exists() and cli(["codegen", "examples/models/mlp.py:build", "--batch", "4",
                                                    "-o", str(build)]) != 0:
        raise RuntimeError("fuzz_cli: could not make the fixture build")
    doc = json.loads(plan.read_text())
    edits = {
        "swapped": lambda d: d["stages"][0]["layers"].reverse() if len(d["stages"][0]["layers"]) > 1
        else d["stages"].reverse(),
        "micro3": lambda d: d["config"].update(micro_batch_size=3),
        "batch1e30": lambda d: d.update(global_batch_size=10 ** 30),
        "world0": lambda d: (d["config"].update(data=0), d["cluster"].update(num_nodes=0)),
        "product": lambda d: d["config"].update(data=d["config"].get("data", 1) * 2),
        "gap": lambda d: d["stages"][-1]["layers"].pop(0) if len(d["stages"][-1]["layers"]) > 1
        else d["stages"][0]["layers"].pop(),
    }
    for name, edit in edits.items():
        d = json.loads(json.dumps(doc))
        edit(d)
        _write_json(tmp / f"plan_{name}.json", d)
    world0 = tmp / "build_world0"
    if not world0.exists():
        shutil.copytree(build, world0)
    info = json.loads((build / "build.json").read_text())
    _write_json(world0 / "build.json", {**info, "world_size": 0})
    a_file = tmp / "a_file.txt"
    a_file.write_text("not a directory\n")
    a_dir = tmp / "a_dir"
    a_dir.mkdir(exist_ok=True)
    return Fixtures(tmp, models, plan, build, a_file, a_dir)


def _numeric(verb_argv: tuple[str, ...], flag: str, values: Sequence[str], tag: str) -> list[Case]:
    return [Case(f"{tag} {flag} {v if len(v) < 12 or not v.isdigit() else 'huge'}", verb_argv + (flag, v))
            for v in values]


def cases(fx: Fixtures) -> list[Case]:
    """Every case, in verb order."""
    m = fx.models
    gpt = ("examples/models/gpt.py:build", "--arg", "preset=tiny")
    mlp = "examples/models/mlp.py:build"
    out_file = lambda name: str(fx.tmp / "out" / name)  # noqa: E731 - a fresh target
    def outs(verb: str) -> dict[str, str]:  # a missing directory of its own per verb: an earlier case creates it
        return {CREATED: str(fx.tmp / f"no_{verb}" / "such" / "x.json"), "a directory": str(fx.a_dir),
                "under a file": str(fx.a_file / "x.json"), "unwritable": "/proc/meshplan_fuzz/x.json"}

    refs = {"syntax error": f"{m}/syntax.py:build", "missing import": f"{m}/missing_import.py:build",
            "factory raises": f"{m}/raises.py:build", "sys.exit": f"{m}/exits.py:build",
            "not callable": f"{m}/not_callable.py:build", "inputs raise": f"{m}/inputs_raise.py:build",
            "returns int": f"{m}/returns_int.py:build", "missing file": f"{m}/nope.py:build",
            "missing name": f"{m}/raises.py:nope", "no colon": f"{m}/raises.py",
            "missing module": "no_such_package_meshplan.models:build"}
    out: list[Case] = []
    # capture
    cap = ("capture", *gpt)
    out += _numeric(cap, "--batch", ["0", "-1", "x", "1e18", HUGE], "capture")
    out += _numeric(cap, "--max-layers", ["-1", "x"], "capture")
    out += [Case(f"capture ref {k}", ("capture", r)) for k, r in refs.items()]
    out.append(Case("capture unknown --arg", ("capture", mlp, "--arg", "nosuch=1")))
    out.append(Case("capture Ctrl-C in factory", ("capture", f"{m}/interrupts.py:build")))
    out += [Case(f"capture -o {k}", cap + ("-o", p), must_fail=k != CREATED) for k, p in outs("capture").items()]
    # optimize
    opt = ("optimize", *gpt, "--cluster", "local", "--devices", "2", "--quiet", "-o", out_file("p.json"))
    out += _numeric(opt, "--batch", ["0", "-1", "x", HUGE, str(2 ** 31 + 1)], "optimize")
    out.append(Case("optimize --batch at cap 2**31", opt + ("--batch", str(2 ** 31)), must_fail=False))
    opt_b = opt + ("--batch", "4")
    out += _numeric(("optimize", *gpt, "--cluster", "local", "--batch", "4", "--quiet", "-o", out_file("p.json")),
                    "--devices", ["0", "-1", "100000"], "optimize")
    out += _numeric(("optimize", *gpt, "--cluster", "dgx-a100-80gb", "--batch", "4", "--quiet",
                     "-o", out_file("p.json")), "--nodes", ["0", "-1", HUGE], "optimize")
    out += _numeric(opt_b, "--constraint", ["tensor=two", "tensor=0", "tensor=-1", "pipeline=1.5",
                                            "max_memory_fraction=abc", "max_memory_fraction=-1"], "optimize")
    out += [Case(f"optimize ref {k}", ("optimize", r, "--cluster", "local", "--batch", "4", "--quiet",
                                       "-o", out_file("p.json"))) for k, r in refs.items() if k != "no colon"]
    out += [Case(f"optimize -o {k}", opt[:-2] + ("--batch", "4", "-o", p), must_fail=k != CREATED)
            for k, p in outs("optimize").items()]
    # show
    out += [Case(f"show plan {k}", ("show", str(fx.tmp / f"plan_{k}.json"), "-o", out_file(f"show_{k}")))
            for k in ("swapped", "micro3", "batch1e30", "world0", "product", "gap")]
    out += [Case("show missing plan", ("show", str(fx.tmp / "nope.json"))),
            Case("show a directory", ("show", str(fx.a_dir)))]
    out += [Case(f"show -o {k}", ("show", str(fx.plan), "-o", p[:-5]), must_fail=k != CREATED)
            for k, p in outs("show").items() if k != "a directory"]
    # cluster
    out += _numeric(("cluster", "dgx-a100-80gb"), "--nodes", ["0", "-1", HUGE, "x"], "cluster")
    out += _numeric(("cluster", "local"), "--devices", ["0", "-1", HUGE], "cluster")
    out += [Case(f"cluster -o {k}", ("cluster", "local", "-o", p), must_fail=k != CREATED)
            for k, p in outs("cluster").items()]
    # codegen
    cg = ("codegen", mlp, "-o", out_file("build"))
    out += _numeric(cg, "--batch", ["0", "-1", HUGE], "codegen")
    out.append(Case("codegen --batch 100000 --data 100000", cg + ("--batch", "100000", "--data", "100000")))
    cg4 = cg + ("--batch", "4")
    for flag in ("--data", "--tensor", "--pipeline", "--micro-batch", "--virtual-stages", "--subgraph",
                 "--spatial", "--replicas-per-direction"):
        out += _numeric(cg4, flag, ["0", "-1"], "codegen")
    out += _numeric(cg4, "--micro-batch", ["3"], "codegen")
    out += _numeric(cg4, "--data", ["8"], "codegen")
    out += _numeric(cg4, "--bucket-mb", ["0", "-1", "nan"], "codegen")
    out += _numeric(cg4, "--lr", ["nan", "-1"], "codegen")
    out += [Case(f"codegen plan {k}", ("codegen", *gpt, "--plan", str(fx.tmp / f"plan_{k}.json"),
                                       "-o", out_file(f"build_{k}")))
            for k in ("swapped", "micro3", "batch1e30", "world0", "product", "gap")]
    out += [Case(f"codegen ref {k}", ("codegen", r, "--batch", "4", "-o", out_file("build_ref")))
            for k, r in refs.items()]
    out.append(Case("codegen unknown --arg", cg4 + ("--arg", "nosuch=1")))
    out += [Case(f"codegen -o {k}", ("codegen", mlp, "--batch", "4", "-o", p[:-5] if k != "a directory"
                                     else str(fx.a_file)), must_fail=k != CREATED) for k, p in outs("codegen").items()]
    # run
    run = ("run", str(fx.build))
    out += _numeric(run, "--steps", ["0", "-1", "x"], "run")
    out += _numeric(run, "--timeout", ["0", "-1", "nan", "inf"], "run")
    out += _numeric(run, "--save-every", ["0", "-1"], "run")
    out += _numeric(run + ("--verify",), "--rtol", ["-1", "nan"], "run")
    out += _numeric(run + ("--verify",), "--atol", ["-1"], "run")
    out += [Case("run --backend nccl" + ("" if _has_cuda() else " (no CUDA)"), run + ("--backend", "nccl"),
                 must_fail=not _has_cuda()),
            Case("run world size 0", ("run", str(fx.tmp / "build_world0"))),
            Case("run missing build", ("run", str(fx.tmp / "nope"))),
            Case("run --resume missing", run + ("--resume", str(fx.tmp / "no_ckpt"))),
            Case("run --checkpoint-dir under a file", run + ("--checkpoint-dir", str(fx.a_file / "ck"))),
            Case("run --checkpoint-dir onto a file", run + ("--checkpoint-dir", str(fx.a_file))),
            Case("run --checkpoint-dir unwritable", run + ("--checkpoint-dir", "/proc/meshplan_fuzz_ck")),
            Case("run Ctrl-C", run + ("--steps", "100000000"), sigint_after=12.0)]
    # checkpoint
    out += [Case("checkpoint show missing", ("checkpoint", "show", str(fx.tmp / "no_ckpt"))),
            Case("checkpoint convert missing", ("checkpoint", "convert", str(fx.tmp / "no_ckpt"),
                                                "-o", out_file("m.pt")))]
    # calibrate: every one must be refused before measuring
    cal = ("calibrate", "--no-run-probe")
    out += _numeric(cal + ("-o", out_file("c.yaml")), "--timeout", ["0", "-1", "nan"], "calibrate")
    out += _numeric(cal + ("-o", out_file("c.yaml")), "--ranks", ["0", "-1", "1", "100000"], "calibrate")
    out += [Case(f"calibrate --out {k}", cal + ("--out", p[:-5] + ".yaml" if k != "a directory" else str(fx.a_dir)))
            for k, p in outs("calibrate").items() if k != CREATED]  # a created directory would start the measurement
    out.append(Case("calibrate --out bad suffix", cal + ("--out", out_file("c.txt"))))
    # compare / simulate
    for verb in ("compare", "simulate"):
        out += [Case(f"{verb} missing build", (verb, str(fx.tmp / "nope"))),
                Case(f"{verb} world size 0", (verb, str(fx.tmp / "build_world0"))),
                Case(f"{verb} --cluster nosuch", (verb, str(fx.build), "--cluster", "nosuch"))]
    return out


def _has_cuda() -> bool:
    """Whether this machine has CUDA (then `--backend nccl` is allowed); read without torch.cuda
    so that the fuzz script itself stays light: nvidia-smi on PATH is the sign."""
    return shutil.which("nvidia-smi") is not None


def classify(case: Case, returncode: int | None, stderr: str) -> str:
    """One of OUTCOMES for a finished (returncode) or killed (None) command."""
    if returncode is None:
        return "HANG"
    if "Traceback (most recent call last)" in stderr:
        return "TRACEBACK"
    if returncode == 0:
        return "SILENT WRONG" if case.must_fail else "success"
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if returncode == 2 and "error:" in last:
        return "clear error"
    if returncode == 130 and "interrupted" in last:  # Ctrl-C, sent or raised by a factory
        return "clear error"
    return "UNCLEAR"


def _default_sigint() -> None:
    """In the child: SIGINT as in a terminal's foreground job. A shell starts background jobs
    (`fuzz_cli.py &`) with SIGINT ignored, children inherit that, and Ctrl-C would then test nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_case(case: Case, env: dict[str, str], cwd: Path, limit: float) -> tuple[str, float, str]:
    """(outcome, seconds, last stderr line) of one case in its own process group."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "planner.app.cli", *case.argv], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_default_sigint)
    try:
        if case.sigint_after is not None:
            try:
                proc.wait(timeout=case.sigint_after)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, err = proc.communicate(timeout=max(1.0, limit - (time.monotonic() - t0)))
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        rc = None
    finally:
        try:  # ranks a killed launcher left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines = [ln for ln in (err or "").splitlines() if ln.strip()]
    return classify(case, rc, err or ""), time.monotonic() - t0, lines[-1][:150] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=float, default=60.0, help="seconds a case may run before it counts as a hang")
    ap.add_argument("--only", default="", help="comma-separated verbs to run (default: all)")
    ap.add_argument("--keep", help="write fixtures and outputs here and keep them (default: a temporary directory)")
    args = ap.parse_args()
    code_root = Path(os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or ROOT).resolve()
    env = {**os.environ, "PYTHONPATH": str(code_root), "OMP_NUM_THREADS": "1"}
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="fuzz_cli_")).resolve()
    tmp.mkdir(parents=True, exist_ok=True)

    def cli(argv: Sequence[str]) -> int:
        return subprocess.run([sys.executable, "-m", "planner.app.cli", *argv], cwd=code_root, env=env,
                              stdout=subprocess.DEVNULL).returncode

    try:
        fx = make_fixtures(tmp, cli)
        only = {v for v in args.only.split(",") if v}
        todo = [c for c in cases(fx) if not only or c.verb in only]
        counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        bad = []
        print(f"code under test: {code_root}; {len(todo)} cases, limit {args.limit:g} s each", flush=True)
        for case in todo:
            outcome, secs, last = run_case(case, env, code_root, args.limit)
            counts[case.verb][outcome] += 1
            print(f"  {outcome:<12} {secs:6.1f} s  {case.name:<44} {last}", flush=True)
            if outcome not in ("clear error", "success"):
                bad.append(case.name)
        print()
        print(f"{'verb':<10} {'cases':>5} " + " ".join(f"{o:>12}" for o in OUTCOMES))
        total = collections.Counter()
        for verb, c in counts.items():
            total.update(c)
            print(f"{verb:<10} {sum(c.values()):>5} " + " ".join(f"{c[o]:>12}" for o in OUTCOMES))
        print(f"{'all':<10} {sum(total.values()):>5} " + " ".join(f"{total[o]:>12}" for o in OUTCOMES))
        return 1 if bad else 0
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
