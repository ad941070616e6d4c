"""Throw damaged documents and files at meshplan's loaders and count the outcomes.

    python benchmarks/fuzz_loaders.py [--n 5000] [--seed 0]

Loaders: plan, cluster and Program documents (mutated dicts) and plan / Program files (cut and
junk-padded bytes), as before; and, for what a run reads from disk: build.json and programs.json
of a build (runtime/launch/build_files.py), a torch checkpoint's record (torch_checkpoint.json), a
meshplan checkpoint's manifest.json and rank file, and a Distributed Checkpoint's .metadata pickle
(bytes cut, padded, flipped; and pickles crafted to run code). Program documents are the per-rank
Programs of three lowered GPT-tiny plans (tests/unit/fuzz_mutations.py).

Outcomes (the same names as the CLI fuzz, benchmarks/fuzz_cli.py):

    ok             loaded (a harmless mutation)
    clear error    the loader's documented error (PlanFileError, ClusterFileError, ProgramError,
                   BuildError, CheckpointError), its message naming the file for file loaders
    unclear        the documented error without the file's name
    traceback      any other exception: a bug
    hang           a load slower than 1 s
    wrong silent   a crafted pickle ran (its marker file exists), or crafted bytes loaded

Exits non-zero unless every outcome is ok or clear error.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import pickle
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "unit")]

import torch  # noqa: E402
import torch.distributed.checkpoint as torch_dcp  # noqa: E402

import planner  # noqa: E402
from cost_models.cluster_file import ClusterFileError  # noqa: E402
from cost_models.hardware import Cluster  # noqa: E402
from examples.models import gpt  # noqa: E402
from fuzz_mutations import mutate, sample_program_docs  # noqa: E402
from planner import Plan, PlanFileError  # noqa: E402
from runtime.launch.build_files import BuildError, read_build, read_build_file  # noqa: E402
from runtime.checkpoint import CheckpointError, Manifest, read_rank_file  # noqa: E402
from runtime.program import Program, ProgramError  # noqa: E402
from runtime.torch_script_checkpoint import TorchCheckpoint  # noqa: E402
from runtime.torch_stack import dcp  # noqa: E402

OUTCOMES = ("ok", "clear error", "unclear", "traceback", "hang", "wrong silent")
DOCUMENTED = (PlanFileError, ClusterFileError, ProgramError, BuildError, CheckpointError)


class Payload:
    """Plain pickle would call open(marker, "w"): the marker is the sign that a crafted pickle ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def damaged(data: bytes, rng: random.Random) -> bytes:
    """`data` cut, padded with junk, and with a few bytes flipped."""
    out = bytearray(data[:rng.randint(0, len(data))] + bytes(rng.randrange(256) for _ in range(rng.randint(0, 4))))
    for _ in range(rng.randint(0, 3)):
        if out:
            out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def crafted_pickles(marker: Path) -> list[bytes]:
    """Pickles that would run code (create `marker`) if unpickled without limits."""
    import os

    return [pickle.dumps(Payload(marker), protocol=p) for p in (2, 4)] + [
        b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.",        # os.system, protocol 0
        b"cbuiltins\neval\n(S'open(" + repr(str(marker)).encode() + b", \"w\")'\ntR.",
        pickle.dumps(os.getcwd)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5000, help="mutated documents per loader")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with torch.device("meta"):
        model = gpt.build(preset="tiny")
    graph = planner.capture(model, gpt.example_inputs(batch_size=2, device="meta", preset="tiny"))
    plan_doc = planner.optimize(graph, Cluster.preset("dgx-a100-80gb", nodes=2), global_batch_size=32,
                                progress=False).to_dict()
    cluster_docs = [Cluster.preset(p).to_dict() for p in ("dgx-a100-80gb", "dgx-h100", "summit")]
    program_docs = sample_program_docs()
    rng = random.Random(args.seed)
    outcomes: dict[str, collections.Counter] = {k: collections.Counter() for k in (
        "plan", "cluster", "plan file bytes", "program", "program file bytes", "build.json bytes",
        "programs.json bytes", "torch record bytes", "manifest bytes", "rank file bytes", "DCP .metadata bytes",
        "crafted pickles")}
    slowest = 0.0
    bad = []

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        marker = tmp / "marker"

        def run(kind, fn, names: Path | None = None, crafted: bool = False):
            nonlocal slowest
            t0 = time.perf_counter()
            try:
                fn()
                outcome = "wrong silent" if crafted else "ok"
            except DOCUMENTED as e:
                outcome = "clear error" if names is None or str(names) in str(e) else "unclear"
                if outcome == "unclear":
                    bad.append(f"{kind}: {type(e).__name__}: {e}")
            except Exception as e:  # noqa: BLE001 - any other error is the bug we hunt
                outcome = "traceback"
                bad.append(f"{kind}: {type(e).__name__}: {e}")
            took = time.perf_counter() - t0
            slowest = max(slowest, took)
            if took > 1.0:
                outcome = "hang"
            if marker.exists():
                outcome = "wrong silent"
                bad.append(f"{kind}: a crafted pickle ran")
                marker.unlink()
            outcomes[kind][outcome] += 1

        build = tmp / "build"
        build.mkdir()
        build_text = json.dumps({"world_size": 2, "target": "meshplan", "entry": "run_rank.py",
                                 "train": {"global_batch_size": 8, "model_ref": "examples/models/gpt.py:build"}}).encode()
        programs_text = json.dumps({str(r): d for r, d in enumerate(program_docs[:2])}).encode()
        ckpt = tmp / "ckpt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch_dcp.save({"model": {"w": torch.ones(2, 3)}, "extra": {"step": 3}}, checkpoint_id=str(ckpt),
                           no_dist=True)
        metadata = (ckpt / dcp.METADATA).read_bytes()
        record_text = json.dumps(TorchCheckpoint(3, 24, "0123456789ab", "m.py:build",
                                                 files=dcp.file_digests(ckpt)).to_dict()).encode()
        rank_bytes = (ckpt / "__0_0.distcp").read_bytes()   # any torch.save'd bytes: a rank file's form
        manifest_doc = {"format_version": 1, "step": 1, "samples": 4, "world_size": 1, "mesh": [["data", 1]],
                        "signature": "s", "model_ref": "m.py:build", "optimizer": "sgd", "global_batch_size": 4,
                        "data_seed": 1000, "layouts": {"0": "l"}, "run_id": "r", "files": {}}
        step = tmp / "step"
        step.mkdir()
        path = tmp / "plan.json"
        ppath = tmp / "program.json"
        text = json.dumps(plan_doc).encode()
        ptexts = [json.dumps(d).encode() for d in program_docs]
        for _ in range(args.n):
            doc = mutate(plan_doc, rng, rng.randint(1, 4))
            run("plan", lambda: Plan.from_dict(doc, origin="fuzz"))
            cdoc = mutate(rng.choice(cluster_docs), rng, rng.randint(1, 4))
            run("cluster", lambda: Cluster.from_dict(cdoc, origin="fuzz"))
            cut = rng.randint(0, len(text))
            junk = bytes(rng.randrange(256) for _ in range(rng.randint(0, 4)))
            path.write_bytes(text[:cut] + junk)
            run("plan file bytes", lambda: Plan.load(path), names=path)
            pdoc = mutate(rng.choice(program_docs), rng, rng.randint(1, 4))
            run("program", lambda: Program.from_dict(pdoc))
            ptext = rng.choice(ptexts)
            ppath.write_bytes(ptext[:rng.randint(0, len(ptext))] + junk)
            run("program file bytes", lambda: Program.load(ppath), names=ppath)
            (build / "build.json").write_bytes(damaged(build_text, rng))
            run("build.json bytes", lambda: read_build(build), names=build / "build.json")
            (build / "programs.json").write_bytes(damaged(programs_text, rng))
            run("programs.json bytes", lambda: read_build_file(build, "programs.json", "per-rank Programs file"),
                names=build / "programs.json")
            (step / "torch_checkpoint.json").write_bytes(damaged(record_text, rng))
            run("torch record bytes", lambda: TorchCheckpoint.load(step), names=step / "torch_checkpoint.json")
            (step / "manifest.json").write_bytes(damaged(json.dumps(mutate(manifest_doc, rng, 1)).encode(), rng))
            run("manifest bytes", lambda: Manifest.load(step), names=step / "manifest.json")
            data = damaged(rank_bytes, rng)
            (step / "rank_0000.pt").write_bytes(data)
            (step / "manifest.json").write_text(json.dumps({**manifest_doc, "files": {"0": {
                "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}}))
            man = Manifest.load(step)
            run("rank file bytes", lambda: read_rank_file(step, 0, man), names=step / "rank_0000.pt")
            (step / dcp.METADATA).write_bytes(damaged(metadata, rng))
            run("DCP .metadata bytes", lambda: dcp.read_metadata(step / dcp.METADATA), names=step / dcp.METADATA)
        for blob in crafted_pickles(marker):
            (step / dcp.METADATA).write_bytes(blob)
            run("crafted pickles", lambda: dcp.read_metadata(step / dcp.METADATA), names=step / dcp.METADATA,
                crafted=True)
            (step / "rank_0000.pt").write_bytes(blob)
            (step / "manifest.json").write_text(json.dumps({**manifest_doc, "files": {"0": {
                "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}}}))
            man = Manifest.load(step)
            run("crafted pickles", lambda: read_rank_file(step, 0, man), names=step / "rank_0000.pt", crafted=True)
    total = sum(sum(c.values()) for c in outcomes.values())
    print(f"{total} damaged inputs (seed {args.seed}); slowest load {slowest * 1e3:.1f} ms")
    print(f"{'loader':<21} {'cases':>6} " + " ".join(f"{o:>12}" for o in OUTCOMES))
    for kind, c in outcomes.items():
        print(f"{kind:<21} {sum(c.values()):>6} " + " ".join(f"{c[o]:>12}" for o in OUTCOMES))
    tot = sum(outcomes.values(), collections.Counter())
    print(f"{'all':<21} {sum(tot.values()):>6} " + " ".join(f"{tot[o]:>12}" for o in OUTCOMES))
    for line in bad[:10]:
        print("  " + line[:300])
    return 1 if any(tot[o] for o in OUTCOMES[2:]) else 0


if __name__ == "__main__":
    sys.exit(main())
