"""Compute in a training run against the calibrated per-op prices: the in-run factor.

    cluster = calibrate(2)                                     # cost_models/calibration/calibrate.py
    cluster = with_in_run(cluster, backend="mpi")              # + fit.in_run.forward / .backward

The op curves and per-kind overheads are timed in chains of one op kind (or one probe
block) called back to back. A forward in a training step runs slower than the sum of
those prices: it follows another micro-batch's backward and an optimizer step that
touched every weight, its rank shares the memory system with the other ranks doing the
same, and the runtime traces every instruction. On the 2-core VM meshplan is developed on,
the forward instructions of a data-parallel GPT ran 8-17% longer than the per-op sum in
six calibrations (benchmarks/accuracy.py; the backward within about 6% either way), and
the same forward in a plain loop in one process ran only ~5% longer. So calibration ends by training a small transformer of its own shape
(planner/app/probe_model.py) for a few steps through the runtime itself, data-parallel over
the calibration's ranks, traced, and sets its measured forward and backward instructions
beside what the planner predicts for them:

    factor = (measured - fixed) / per_op_sum

where `fixed` is what the simulator adds per instruction besides the per-op sum (the
stage call, the executor's extra, the loss; already measured in a run's context) and
`per_op_sum` is the planner's sum over the stage's nodes, whose prices the factor then
scales (planner.evaluate reads it through cost_models.calibrated.in_run_factors).

Outside [0.7, 1.6] the probe run went wrong (another process took the cores for all of
it, or its trace is broken): no factor is written and the per-op prices are kept.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path
from typing import Callable

import cost_models.calibration.calibrate
import planner
from codegen.emit import capture_ref, emit
from planner.app.commands import make_fixed_plan
from planner.app.compare import compare_build
from runtime.launch.launcher import run_local
from runtime.vocab import Backend, DType

# The probe run: micro-batches of MICRO samples, MICRO_BATCHES of them per rank and step.
MICRO, MICRO_BATCHES, STEPS = 2, 2, 8
LAUNCHES = 5
FACTOR_RANGE = (0.7, 1.6)
PROBE_FILE = Path(__file__).with_name("probe_model.py")


class InRunError(ValueError):
    """The probe training run could not be built, run or compared; the message says why."""


def in_run_factor(measured: float, predicted: float, per_op: float) -> float | None:
    """(measured - (predicted - per_op)) / per_op; None when per_op is 0, or when the factor falls
    outside FACTOR_RANGE (a disturbed run or a broken trace: the per-op prices are kept).

    Seconds, all three summed alike (per step over ranks): the measured instructions, the
    predicted ones, and the per-op part of the prediction."""
    if per_op <= 0 or measured <= 0:
        return None
    factor = (measured - (predicted - per_op)) / per_op
    return factor if FACTOR_RANGE[0] <= factor <= FACTOR_RANGE[1] else None


def measure_in_run(cluster, backend: str = Backend.GLOO.value, *, workdir: str | Path | None = None, steps: int = STEPS,
                   launches: int = LAUNCHES, timeout: float = 120.0,
                   progress: Callable[[str], None] | None = None) -> dict[str, float]:
    """Train the probe model data-parallel over the cluster's devices of one node for `steps`
    steps, traced, `launches` times (about 5 s each on 2 cores), and return fit.in_run.* and
    raw.in_run.* (seconds per step summed over ranks; the median launch's).

    `cluster` must not carry in-run factors yet (they would price the prediction)."""
    world = cluster.num_devices if cluster.num_nodes == 1 else cluster.devices_per_node
    if world < 2:
        raise InRunError(f"the in-run probe trains data-parallel over at least 2 ranks; cluster "
                         f"{cluster.name!r} has {world} device(s) per node")
    if steps < 3:
        raise InRunError(f"steps={steps}: the probe needs at least 3 (the first is warm-up)")
    if launches < 1:
        raise InRunError(f"launches={launches}: the probe needs at least one launch")
    if any(name.startswith("fit.in_run.") for name, _ in cluster.measurements):
        raise InRunError("the cluster already carries fit.in_run.*; measure from the calibration without them")
    ref = f"{PROBE_FILE}:build"
    cfg = planner.ParallelConfig(micro_batch_size=MICRO, dtype=DType.FP32, data=world)
    graph = capture_ref(ref, {}, batch_size=MICRO)
    plan = make_fixed_plan(graph, cluster, cfg, world * MICRO * MICRO_BATCHES)
    runs = []  # per launch: compare_build's (Comparison, predicted, measured, plan priced on the cluster)
    with tempfile.TemporaryDirectory(prefix="meshplan-in-run-") as tmp:
        out = Path(workdir) if workdir is not None else Path(tmp)
        build = emit(plan, ref, None, out / "probe_build", graph=graph,
                     optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.9}).path
        for k in range(launches):
            if progress:
                progress(f"in-run probe {k + 1}/{launches}: training a {world}-rank data-parallel transformer "
                         f"for {steps} steps, traced ...")
            res = run_local(build, steps=steps, backend=backend, timeout=timeout)
            if res.returncode != 0:
                raise InRunError(f"the probe training run failed (exit {res.returncode}); its output ends:\n"
                                 f"{res.output[-2000:]}\ncalibrate without it: meshplan calibrate --no-run-probe")
            runs.append(compare_build(build, cluster))
    stage = runs[0][3].prediction.stages[0]
    m = {}
    for op, per_op, name in (("F", stage.forward, "forward"), ("B", stage.backward, "backward")):
        got = [next((k for k in cmp.kinds if k.op == op), None) for cmp, *_ in runs]
        if any(k is None for k in got):
            raise InRunError(f"the probe run's trace has no {op} instruction; was it traced?")
        # the median launch: one launch in a few runs every instruction up to twice as long (another
        # process, or the virtual machine, took the cores for its whole few seconds)
        measured = statistics.median(k.measured for k in got)
        total = per_op * world * MICRO_BATCHES  # the per-op sum over every rank's instructions of a step
        factor = in_run_factor(measured, got[0].predicted, total)
        m[f"raw.in_run.{name}.measured"], m[f"raw.in_run.{name}.predicted"] = measured, got[0].predicted
        m[f"raw.in_run.{name}.per_op"] = total
        for i, k in enumerate(got):
            m[f"raw.in_run.{name}.launch{i}"] = k.measured
        if factor is not None:
            m[f"fit.in_run.{name}"] = factor
    if progress:
        progress("  forward instructions " + _fmt(m, "forward") + "; backward " + _fmt(m, "backward"))
    return m


def _fmt(m: dict[str, float], name: str) -> str:
    got = m.get(f"fit.in_run.{name}")
    return (f"{m[f'raw.in_run.{name}.measured'] * 1e3:.2f} ms measured, "
            f"{m[f'raw.in_run.{name}.predicted'] * 1e3:.2f} ms predicted: per-op prices x"
            + (f"{got:.3f}" if got is not None else f"1 (kept: the ratio is outside {FACTOR_RANGE})"))


def with_in_run(cluster, backend: str = Backend.GLOO.value, **kwargs):
    """`cluster` with the in-run probe's measurements added (see measure_in_run)."""
    got = measure_in_run(cluster, backend, **kwargs)
    # Cluster keeps measurements as sorted pairs whatever mapping it is given
    return dataclasses.replace(cluster, measurements={**dict(cluster.measurements), **got})


def calibrate_machine(ranks: int | None = None, *, quick: bool = True, backend: str = Backend.GLOO.value, timeout: float = 300.0,
                      run_probe: bool = True, progress: Callable[[str], None] | None = print):
    """cost_models.calibration.calibrate.calibrate, then (run_probe) the in-run probe (with_in_run). A probe that
    fails leaves the calibration as it is and says so through `progress`: nothing measured is lost."""
    cluster = cost_models.calibration.calibrate.calibrate(ranks, quick=quick, backend=backend, timeout=timeout,
                                                          progress=progress)
    if not run_probe:
        return cluster
    try:
        return with_in_run(cluster, backend, launches=LAUNCHES if quick else 2 * LAUNCHES - 1,
                           timeout=min(timeout, 120.0), progress=progress)
    except InRunError as e:
        if progress:
            progress(f"warning: the in-run probe gave nothing ({e}); the per-op prices stand as calibrated")
        return cluster
