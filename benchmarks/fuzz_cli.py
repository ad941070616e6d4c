"""Throw bad inputs at every `meshplan` verb and classify what each one does.

    python benchmarks/fuzz_cli.py [--limit 60] [--only capture,run] [--case NAME] [--keep DIR]

Every case runs `python -m planner.app.cli ...` in a subprocess of its own (PYTHONPATH: this
checkout, or the one in $PYTHONPATH when set) under a wall-clock limit (seconds), and
ends as one of:

    clear error   exit 2 (exit 130 "interrupted" after Ctrl-C), no traceback, the last line on
                  stderr says "error:" (argparse's usage line before it is fine)
    success       exit 0 where the input is allowed (a value at a documented cap)
    SILENT WRONG  exit 0 for an input that cannot be right (world size 0, a batch the
                  micro-batch does not divide, ...), or any exit after which a file the case
                  watches was changed (a checkpoint shard, a user's file) or a marker file that a
                  crafted checkpoint's code would create exists
    TRACEBACK     a Python traceback on stderr
    HANG          still running at the limit (killed)
    UNCLEAR       any other exit: non-zero without a traceback and without a one-line error

The inputs: numeric options at 0, -1, huge and non-numbers; output paths that are missing,
unwritable, a directory or under a file; model references broken in every way (syntax
error, missing import, a factory that raises, calls sys.exit, is not callable, gets an
unknown keyword, example_inputs that raises); hand-edited plans and builds, and truncated,
non-UTF-8 or damaged build.json / programs.json / plan.json; checkpoints crafted to run code
(a Distributed Checkpoint's .metadata, a rank file), changed after the save, or with a record
that is not JSON; outputs onto existing files and into a checkpoint; pre-launch checks (an
unwritable --tensorboard, dataset samples beyond the model's positions or vocabulary, a
non-torch --init checkpoint, --no-loss-scale without fp16, huge --warmup-steps); Ctrl-C
during a run. With `runs` (the benchmark; not the in-process test) the fixtures include a
real run's checkpoint for the cases that need one. `cases()` is shared with tests/unit/test_cli_bad_inputs.py, which runs a
sample of them in-process. Exits non-zero unless every case ends as a clear error or an
allowed success.
"""

from __future__ import annotations

import argparse
import array
import collections
import dataclasses
import hashlib
import json
import os
import pickle
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


class Payload:
    """Pickled into a crafted checkpoint file: plain pickle would call open(marker, "w"), creating the
    marker (a stand-in for any code). The fuzz checks that the marker never appears."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@dataclasses.dataclass(frozen=True)
class Case:
    """One command line. `must_fail`: a bad input (exit 0 is a silent wrong result);
    `sigint_after`: seconds after which Ctrl-C reaches the command's process group."""

    name: str
    argv: tuple[str, ...]
    must_fail: bool = True
    sigint_after: float | None = None
    must_not_exist: tuple[str, ...] = ()   # marker files a crafted file's code would create, temporaries to sweep
    unchanged: tuple[str, ...] = ()        # files the command must leave as they were
    plant: tuple[str, ...] = ()            # files created (a few bytes) just before the command runs

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


def make_fixtures(tmp: Path, cli: Callable[[Sequence[str]], int], runs: bool = False) -> Fixtures:
    """Write the broken models, a valid plan and build (through `cli`, argv -> exit status),
    their hand-edited and damaged copies, crafted checkpoints and data files under `tmp`; with
    `runs`, also a real run's checkpoint (ckpt_real)."""
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
    _damaged_builds(tmp, build)
    _checkpoints(tmp)
    _data_files(tmp)
    if runs:
        ckpt = tmp / "ckpt_real"
        if not ckpt.exists() and cli(["run", str(build), "--steps", "1", "--quiet", "--checkpoint-dir", str(ckpt)]) != 0:
            raise RuntimeError("fuzz_cli: could not make the fixture checkpoint")
        torch_build = tmp / "build_torch_real"   # a real torch-target build: its ranks read the checkpoint
        if not (torch_build / "build.json").exists() and cli(["codegen", "examples/models/mlp.py:build", "--batch", "4",
                                                              "--target", "torch", "-o", str(torch_build)]) != 0:
            raise RuntimeError("fuzz_cli: could not make the fixture torch build")
    return Fixtures(tmp, models, plan, build, a_file, a_dir)


def _damaged_builds(tmp: Path, build: Path) -> None:
    """Copies of the build with one file damaged: build_json (truncated build.json), build_utf8 (programs.json
    not UTF-8), build_plan (plan.json not JSON), build_torch (build.json says target torch: its --resume reads
    Distributed Checkpoints)."""
    for name, file, edit in (("build_json", "build.json", lambda b: b[: len(b) // 2]),
                             ("build_utf8", "programs.json", lambda b: b"\xff\xfe" + b),
                             ("build_plan", "plan.json", lambda b: b"{" + b[:40]),
                             ("build_torch", "build.json", lambda b: json.dumps(
                                 {**json.loads(b), "target": "torch"}).encode())):
        copy = tmp / name
        if not copy.exists():
            shutil.copytree(build, copy)
        (copy / file).write_bytes(edit((build / file).read_bytes()))


def _digests(step: Path) -> dict:
    """As runtime/torch_stack/dcp.file_digests records them (written out here: the fuzz also runs older code)."""
    return {f.name: {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "bytes": f.stat().st_size}
            for f in sorted(step.iterdir()) if f.name.endswith(".metadata") or f.suffix == ".distcp"}


def _torch_checkpoints(tmp: Path) -> None:
    """Four torch-target checkpoints, saved by torch.distributed.checkpoint in this process (torch is
    imported here only)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    for name in ("honest", "crafted", "changed", "not_json"):
        step = tmp / f"ckpt_{name}" / "step_00000003"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": {"w": torch.ones(2, 3)}, "extra": {"step": 3}}, checkpoint_id=str(step), no_dist=True)
        if name == "crafted":
            (step / ".metadata").write_bytes(pickle.dumps(Payload(tmp / "marker_metadata")))
        record = {"step": 3, "samples": 12, "run_id": "0123456789ab", "model_ref": "examples/models/mlp.py:build",
                  "format": 1, "files": _digests(step)}
        (step / "torch_checkpoint.json").write_text("{not json" if name == "not_json" else json.dumps(record))
        (step.parent / "latest").write_text(step.name)
        if name == "changed":
            data = bytearray((step / "__0_0.distcp").read_bytes())
            data[-1] ^= 0xFF
            (step / "__0_0.distcp").write_bytes(bytes(data))


def _checkpoints(tmp: Path) -> None:
    """Torch-target checkpoints (honest, .metadata crafted to create marker_metadata, a .distcp changed after
    the save, a record that is not JSON), and meshplan checkpoints (a rank file crafted to create marker_rank,
    a manifest that is not JSON), made without a run."""
    if not (tmp / "ckpt_not_json").exists():
        _torch_checkpoints(tmp)
    for name, rank_file in (("ckpt_rank", pickle.dumps(Payload(tmp / "marker_rank"))), ("ckpt_manifest", b"x")):
        step = tmp / name / "step_00000001"
        step.mkdir(parents=True, exist_ok=True)
        (step / "rank_0000.pt").write_bytes(rank_file)
        manifest = {"format_version": 1, "step": 1, "samples": 4, "world_size": 1, "mesh": [["data", 1]],
                    "signature": "s", "model_ref": "examples/models/mlp.py:build", "optimizer": "sgd",
                    "global_batch_size": 4, "data_seed": 1000, "layouts": {"0": "l"}, "run_id": "0123456789ab",
                    "files": {"0": {"sha256": hashlib.sha256(rank_file).hexdigest(), "bytes": len(rank_file)}}}
        (step / "manifest.json").write_text("{not json" if name == "ckpt_manifest" else json.dumps(manifest))
    existing = tmp / "existing"
    existing.mkdir(exist_ok=True)
    for name in ("model.pt", "graph.json", "plan.json", "cluster.yaml", "cal.yaml", "show_report.html"):
        (existing / name).write_text("a file of the user's\n")
    (existing / "dir_of_files").mkdir(exist_ok=True)
    (existing / "dir_of_files" / "notes.txt").write_text("the user's\n")


def _data_files(tmp: Path) -> None:
    """tokens.bin (ids < 100, gpt tiny's vocabulary is 128) and big_ids.bin (ids up to 999), token files of
    examples/data/tokens.py; not_torch.pt, a file that is not torch.save's."""
    for name, ids in (("tokens.bin", [i % 100 for i in range(4000)]), ("big_ids.bin", [i % 1000 for i in range(4000)])):
        (tmp / name).write_bytes(array.array("H", ids).tobytes())
        (tmp / f"{name}.json").write_text(json.dumps({"dtype": "uint16", "num_tokens": len(ids),
                                                      "vocab_size": max(ids) + 1}))
    (tmp / "not_torch.pt").write_text("weights, honestly\n")


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
    ex = fx.tmp / "existing"
    out.append(Case("capture -o existing file", cap + ("-o", str(ex / "graph.json")), unchanged=(str(ex / "graph.json"),)))
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
    out.append(Case("optimize -o existing file", opt[:-2] + ("--batch", "4", "-o", str(ex / "plan.json")),
                    unchanged=(str(ex / "plan.json"),)))
    # show
    out += [Case(f"show plan {k}", ("show", str(fx.tmp / f"plan_{k}.json"), "-o", out_file(f"show_{k}")))
            for k in ("swapped", "micro3", "batch1e30", "world0", "product", "gap")]
    out += [Case("show missing plan", ("show", str(fx.tmp / "nope.json"))),
            Case("show a directory", ("show", str(fx.a_dir)))]
    out += [Case(f"show -o {k}", ("show", str(fx.plan), "-o", p[:-5]), must_fail=k != CREATED)
            for k, p in outs("show").items() if k != "a directory"]
    out.append(Case("show -o existing report", ("show", str(fx.plan), "-o", str(ex / "show")),
                    unchanged=(str(ex / "show_report.html"),)))
    # cluster
    out += _numeric(("cluster", "dgx-a100-80gb"), "--nodes", ["0", "-1", HUGE, "x"], "cluster")
    out += _numeric(("cluster", "local"), "--devices", ["0", "-1", HUGE], "cluster")
    out += [Case(f"cluster -o {k}", ("cluster", "local", "-o", p), must_fail=k != CREATED)
            for k, p in outs("cluster").items()]
    out.append(Case("cluster -o existing file", ("cluster", "local", "-o", str(ex / "cluster.yaml")),
                    unchanged=(str(ex / "cluster.yaml"),)))
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
    out.append(Case("codegen -o a directory of other files", ("codegen", mlp, "--batch", "4", "-o",
                                                               str(ex / "dir_of_files"))))
    # checked before the capture or right after it, never at step 0 in the ranks
    out += [Case("codegen --no-loss-scale fp32", cg4 + ("--no-loss-scale",)),
            Case("codegen --warmup-steps huge", cg4 + ("--warmup-steps", HUGE)),
            Case("codegen --decay-steps huge", cg4 + ("--lr-schedule", "cosine", "--decay-steps", HUGE)),
            Case("codegen --init checkpoint not torch", cg4 + ("--init", "checkpoint", "--checkpoint",
                                                               str(fx.tmp / "not_torch.pt"))),
            Case("codegen --init checkpoint missing", cg4 + ("--init", "checkpoint", "--checkpoint",
                                                             str(fx.tmp / "nope.pt")))]
    tokens = ("--dataset", "examples/data/tokens.py:TokenFile")
    out += [Case("codegen --dataset samples longer than positions",
                 ("codegen", *gpt, "--batch", "4", *tokens, "--dataset-arg", f"path={fx.tmp / 'tokens.bin'}",
                  "--dataset-arg", "seq_len=32", "-o", out_file("build_ds"))),
            Case("codegen --dataset ids beyond vocabulary",
                 ("codegen", *gpt, "--batch", "4", *tokens, "--dataset-arg", f"path={fx.tmp / 'big_ids.bin'}",
                  "--dataset-arg", "seq_len=16", "-o", out_file("build_ds")))]
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
    t = fx.tmp
    marker_md, marker_rank = str(t / "marker_metadata"), str(t / "marker_rank")
    out += [Case("run --tensorboard onto a file", run + ("--tensorboard", str(fx.a_file))),
            Case("run --tensorboard under a file", run + ("--tensorboard", str(fx.a_file / "tb"))),
            Case("run --tensorboard unwritable", run + ("--tensorboard", "/proc/meshplan_fuzz_tb")),
            Case("run truncated build.json", ("run", str(t / "build_json"))),
            Case("run --verify non-UTF-8 programs.json", ("run", str(t / "build_utf8"), "--verify", "--quiet")),
            Case("run --resume crafted .metadata", ("run", str(t / "build_torch"), "--resume", str(t / "ckpt_crafted")),
                 must_not_exist=(marker_md,)),
            Case("run --resume crafted .metadata, torch build", ("run", str(t / "build_torch_real"), "--resume",
                                                                   str(t / "ckpt_crafted")), must_not_exist=(marker_md,)),
            Case("run --resume changed .distcp", ("run", str(t / "build_torch"), "--resume", str(t / "ckpt_changed"))),
            Case("run --resume record not JSON", ("run", str(t / "build_torch"), "--resume", str(t / "ckpt_not_json"))),
            Case("run --resume crafted rank file", run + ("--resume", str(t / "ckpt_rank")),
                 must_not_exist=(marker_rank,)),
            Case("run --resume manifest not JSON", run + ("--resume", str(t / "ckpt_manifest")))]
    real = t / "ckpt_real" / "step_00000001"   # made with `runs` only
    shard = str(real / "rank_0000.pt")
    out += [Case("run --resume after an interrupted save sweeps it",
                 run + ("--steps", "1", "--quiet", "--checkpoint-dir", str(t / "ckpt_real"), "--resume",
                        str(t / "ckpt_real")), must_fail=False,
                 plant=(str(real / ".rank_0000.pt.fuzz1234.tmp"),),
                 must_not_exist=(str(real / ".rank_0000.pt.fuzz1234.tmp"),))]
    # checkpoint
    out += [Case("checkpoint show missing", ("checkpoint", "show", str(fx.tmp / "no_ckpt"))),
            Case("checkpoint convert missing", ("checkpoint", "convert", str(fx.tmp / "no_ckpt"),
                                                "-o", out_file("m.pt"))),
            Case("checkpoint show crafted .metadata", ("checkpoint", "show", str(t / "ckpt_crafted")),
                 must_not_exist=(marker_md,)),
            Case("checkpoint convert crafted .metadata", ("checkpoint", "convert", str(t / "ckpt_crafted"),
                                                          "-o", out_file("crafted.pt")), must_not_exist=(marker_md,)),
            Case("checkpoint show changed .distcp", ("checkpoint", "show", str(t / "ckpt_changed"))),
            Case("checkpoint show record not JSON", ("checkpoint", "show", str(t / "ckpt_not_json"))),
            Case("checkpoint show manifest not JSON", ("checkpoint", "show", str(t / "ckpt_manifest"))),
            Case("checkpoint show torch checkpoint", ("checkpoint", "show", str(t / "ckpt_honest")), must_fail=False),
            Case("checkpoint convert torch checkpoint", ("checkpoint", "convert", str(t / "ckpt_honest"), "-o",
                                                         out_file("honest.pt")), must_fail=False),
            Case("checkpoint convert -o existing file", ("checkpoint", "convert", str(t / "ckpt_honest"), "-o",
                                                         str(ex / "model.pt")), unchanged=(str(ex / "model.pt"),)),
            Case("checkpoint convert -o a shard", ("checkpoint", "convert", str(t / "ckpt_real"), "-o", shard),
                 unchanged=(shard,)),
            Case("checkpoint convert -o a shard --force", ("checkpoint", "convert", str(t / "ckpt_real"), "-o", shard,
                                                            "--force"), unchanged=(shard,)),
            Case("checkpoint convert -o into a torch checkpoint",
                 ("checkpoint", "convert", str(t / "ckpt_honest"), "-o", str(t / "ckpt_honest" / "model.pt")),
                 must_not_exist=(str(t / "ckpt_honest" / "model.pt"),))]
    # calibrate: every one must be refused before measuring
    cal = ("calibrate", "--no-run-probe")
    out += _numeric(cal + ("-o", out_file("c.yaml")), "--timeout", ["0", "-1", "nan"], "calibrate")
    out += _numeric(cal + ("-o", out_file("c.yaml")), "--ranks", ["0", "-1", "1", "100000"], "calibrate")
    out += [Case(f"calibrate --out {k}", cal + ("--out", p[:-5] + ".yaml" if k != "a directory" else str(fx.a_dir)))
            for k, p in outs("calibrate").items() if k != CREATED]  # a created directory would start the measurement
    out.append(Case("calibrate --out existing file", cal + ("--out", str(ex / "cal.yaml")),
                    unchanged=(str(ex / "cal.yaml"),)))
    out.append(Case("calibrate --out bad suffix", cal + ("--out", out_file("c.txt"))))
    # compare / simulate
    for verb in ("compare", "simulate"):
        out += [Case(f"{verb} missing build", (verb, str(fx.tmp / "nope"))),
                Case(f"{verb} world size 0", (verb, str(fx.tmp / "build_world0"))),
                Case(f"{verb} --cluster nosuch", (verb, str(fx.build), "--cluster", "nosuch"))]
        out += [Case(f"{verb} truncated build.json", (verb, str(t / "build_json"))),
                Case(f"{verb} non-UTF-8 programs.json", (verb, str(t / "build_utf8"))),
                Case(f"{verb} damaged plan.json", (verb, str(t / "build_plan")))]
    return out


def _has_cuda() -> bool:
    """Whether this machine has CUDA (then `--backend nccl` is allowed); read without torch.cuda
    so that the fuzz script itself stays light (torch is imported only to write checkpoint fixtures):
    nvidia-smi on PATH is the sign."""
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


def _digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def side_effects(case: Case, before: dict[str, str | None]) -> str | None:
    """What the command did that it must not have (a marker that exists, a watched file changed), or None."""
    made = [p for p in case.must_not_exist if Path(p).exists()]
    changed = [p for p, digest in before.items() if _digest(p) != digest]
    if made or changed:
        return "; ".join([f"{p} exists" for p in made] + [f"{p} changed" for p in changed])
    return None


def run_case(case: Case, env: dict[str, str], cwd: Path, limit: float) -> tuple[str, float, str]:
    """(outcome, seconds, last stderr line) of one case in its own process group."""
    for p in case.must_not_exist:   # an earlier case's (a marker left by a crafted file that ran) is not this one's
        Path(p).unlink(missing_ok=True)
    for p in case.plant:
        if Path(p).parent.is_dir():
            Path(p).write_bytes(b"left by a save that was killed")
    before = {p: _digest(p) for p in case.unchanged}
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
    wrong = side_effects(case, before)
    if wrong is not None:
        return "SILENT WRONG", time.monotonic() - t0, wrong[:150]
    return classify(case, rc, err or ""), time.monotonic() - t0, lines[-1][:150] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=float, default=60.0, help="seconds a case may run before it counts as a hang")
    ap.add_argument("--only", default="", help="comma-separated verbs to run (default: all)")
    ap.add_argument("--case", action="append", default=[], help="run only the case of this name (repeatable)")
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
        fx = make_fixtures(tmp, cli, runs=True)
        only = {v for v in args.only.split(",") if v}
        todo = [c for c in cases(fx) if (not only or c.verb in only) and (not args.case or c.name in args.case)]
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
