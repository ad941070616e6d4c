"""The torch target versus meshplan's own runtime on the same plans (gloo, CPU): step time ratio.

For the example GPT (preset "small" by default) and the plans d2, d2 ZeRO-3, t2 (2 ranks), d2 x t2 and
d2 x p2 1F1B (4 ranks), one plan is made per configuration (make_fixed_plan for Target.TORCH, so both
builds carry the same stage split and tensor-parallel regions) and written out twice: as a meshplan build
(codegen.emit.emit: per-rank scripts run by meshplan's executor) and as a torch build
(codegen.torch_target.script.emit_torch: one SPMD script on DeviceMesh, DTensor, FSDP2 and
torch.distributed.pipelining). Both builds hold the same plan.json (checked) and train the same model
with the same data, SGD with momentum, micro-batch and global batch.

The builds run alternately in one invocation: in round r every plan runs meshplan then torch for odd r
and torch then meshplan for even r, each run `--steps` steps, so the machine's drifting load hits both
alike. Each world size's runs go through one set of worker processes (runtime.launch.launcher.run_many with
through_workers), so Python's and torch's start-up is paid once per world size; every run still builds
its model, mesh and process group afresh, hence the warm-up steps dropped from every run. Each run has
its own copy of its build directory, whose metrics.jsonl keeps that run's step `seconds` (rank 0's wall
clock around the whole step: batch read, forward, backward, gradient communication, optimizer step).
Both run with --no-trace (meshplan's executor would otherwise record a Timeline over its first steps).

Printed per plan: the median step time of each target over every round's steps after warm-up, the
ratio torch / meshplan of those medians, and its spread: the min..max and the median over the rounds of
the ratio of that round's two medians (the pooled ratio may fall outside the rounds' range when the
load changed between rounds). A measurement without a target: the exit status is 0 whatever the ratio.

    python benchmarks/torch_target.py [--plans d2 t2 ...] [--rounds 3] [--steps 12] [--warmup 2]
                                      [--preset small] [--batch 16] [--micro-batch 4] [--json FILE]
    python benchmarks/torch_target.py --quick        # d2 and t2, 2 rounds of 6 steps
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPT = str(ROOT / "examples/models/gpt.py") + ":build"
SGD = {"name": "sgd", "lr": 0.01, "momentum": 0.9}
# name -> ParallelConfig fields
PLANS = {
    "d2": dict(data=2),
    "d2_zero3": dict(data=2, zero=3),
    "t2": dict(tensor=2),
    "d2t2": dict(data=2, tensor=2),
    "d2p2_1f1b": dict(data=2, pipeline=2, schedule="1f1b"),
}
QUICK = ("d2", "t2")
TARGETS = ("meshplan", "torch")


def make_builds(name: str, graph, args, out: Path) -> dict[str, Path]:
    """The meshplan and the torch build of plan `name` for the captured GPT `graph` under out/<target>;
    ValueError if their plans differ."""
    import planner
    from codegen.emit import emit
    from codegen.torch_target.script import emit_torch
    from planner.app.commands import make_fixed_plan
    from runtime.vocab import Target

    cfg = planner.ParallelConfig(micro_batch_size=args.micro_batch, dtype="fp32", **PLANS[name])
    plan = make_fixed_plan(graph, planner.Cluster.preset("local", devices=cfg.num_devices), cfg, args.batch,
                           Target.TORCH)
    setup = dict(model_kwargs={"preset": args.preset}, graph=graph, optimizer=SGD)
    builds = {"meshplan": emit(plan, GPT, None, out / "meshplan", **setup).path,
              "torch": emit_torch(plan, GPT, None, out / "torch", **setup).path}
    plans = {t: json.loads((b / "plan.json").read_text()) for t, b in builds.items()}
    if plans["meshplan"] != plans["torch"]:
        raise ValueError(f"{name}: the meshplan and torch builds hold different plans; both must come from one plan")
    return builds


def run_alternating(builds: dict[str, dict[str, Path]], args, tmp: Path) -> dict[str, dict[str, list[list[float]]]]:
    """plan -> target -> one list of rank 0's step seconds per round (warm-up steps included)."""
    from runtime.launch.launcher import read_build, run_many

    times: dict[str, dict[str, list[list[float]]]] = {p: {t: [] for t in TARGETS} for p in builds}
    by_world: dict[int, list[str]] = {}
    for p, b in builds.items():
        by_world.setdefault(int(read_build(b["torch"])["world_size"]), []).append(p)
    for world, plans in sorted(by_world.items()):
        runs = []   # (plan, target, its own copy of the build)
        for r in range(1, args.rounds + 1):
            for p in plans:
                for t in (TARGETS if r % 2 else TARGETS[::-1]):
                    copy = tmp / "runs" / f"{p}_{t}_r{r}"
                    shutil.copytree(builds[p][t], copy)
                    runs.append((p, t, copy))
        print(f"{world} ranks: {len(runs)} runs of {args.steps} steps ({', '.join(plans)})", flush=True)
        results = run_many([c for _p, _t, c in runs], steps=args.steps, timeout=120, extra_args=["--no-trace"])
        if results[0].returncode:   # one set of processes ran them all: its exit status and output are shared
            raise RuntimeError(f"the {world}-rank runs failed with exit status {results[0].returncode}:\n"
                               f"{results[0].output[-4000:]}")
        for p, t, copy in runs:
            lines = (copy / "metrics.jsonl").read_text().splitlines()
            times[p][t].append([json.loads(ln)["seconds"] for ln in lines])
    return times


def summarize(times: dict[str, list[list[float]]], warmup: int) -> dict:
    """Medians (s) of each target over every round's steps after warm-up, their ratio, the per-round spread."""
    kept = {t: [s[warmup:] for s in times[t]] for t in TARGETS}
    med = {t: statistics.median([x for run in kept[t] for x in run]) for t in TARGETS}
    per_round = [statistics.median(o) / statistics.median(m) for m, o in zip(kept["meshplan"], kept["torch"])]
    return {"meshplan_s": med["meshplan"], "torch_s": med["torch"], "ratio": med["torch"] / med["meshplan"],
            "round_ratios": per_round, "steps": {t: times[t] for t in TARGETS}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", nargs="+", choices=sorted(PLANS), default=list(PLANS),
                    help="plans to measure (default all; d2t2 and d2p2_1f1b take 4 ranks)")
    ap.add_argument("--quick", action="store_true", help="d2 and t2 only, 2 rounds of 6 steps")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every plan once per target")
    ap.add_argument("--steps", type=int, default=12, help="steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of every run left out")
    ap.add_argument("--preset", default="small", help="the example GPT's preset")
    ap.add_argument("--batch", type=int, default=16, help="global batch (samples per step)")
    ap.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch")
    ap.add_argument("--json", type=Path, help="also write the figures (and every step time) to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.plans, args.rounds, args.steps = list(QUICK), 2, 6
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}; give more steps")
    os.environ["OMP_NUM_THREADS"] = "1"   # the ranks inherit it: one thread per rank on a shared CPU
    from codegen.emit import capture_ref

    graph = capture_ref(GPT, {"preset": args.preset}, batch_size=args.micro_batch)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {p: make_builds(p, graph, args, Path(tmp) / p) for p in args.plans}
        times = run_alternating(builds, args, Path(tmp))
    figures = {p: summarize(times[p], args.warmup) for p in args.plans}
    print(f"GPT preset {args.preset!r}, global batch {args.batch} in micro-batches of {args.micro_batch}, "
          f"SGD momentum, gloo CPU; {args.rounds} alternating rounds of {args.steps} steps per target "
          f"(median after {args.warmup} warm-up steps of every run)")
    print(f"  {'plan':<10} {'meshplan ms':>12} {'torch ms':>10} {'torch/meshplan':>15}  "
          "per-round ratios: min..max (median)")
    for p, f in figures.items():
        rounds = f["round_ratios"]
        print(f"  {p:<10} {f['meshplan_s'] * 1e3:12.1f} {f['torch_s'] * 1e3:10.1f} {f['ratio']:15.3f}  "
              f"{min(rounds):.3f}..{max(rounds):.3f} ({statistics.median(rounds):.3f})")
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "batch": args.batch, "micro_batch": args.micro_batch,
                                         "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                                         "plans": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
