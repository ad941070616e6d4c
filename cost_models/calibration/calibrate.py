"""`meshplan calibrate`: measure this machine with the runtime and write a calibrated Cluster file.

    cluster = calibrate(ranks=2, quick=True)          # benchmarks/calibration_timing.py: how long
    cluster.save("cluster.yaml")                      # Cluster.load gives it back

W rank processes (cost_models/calibration/worker.py) run at once, one thread
each, as a training run's ranks do; they time the cost model's op kinds, the
peak GEMM rate and copy bandwidth, and the collectives and p2p of the
runtime's communicator (gloo, MPI or NCCL) for every group size 2..W. This
module fits the constants and builds the Cluster:

- device: peak fp32 FLOP/s = the measured GEMM rate, memory bandwidth = the
  measured copy rate (medians over the ranks), both times the share of a core
  a rank gets while it computes between collectives (fit.cpu_share: CPU time
  over wall time, calibration.worker.run_like_share; 1 on an otherwise idle
  machine), since the op timings are medians of unpreempted runs and a step is
  not; fixed costs are divided by it;
- Efficiency (fit.eff.*, fit.overhead.*): per-kind forward/backward overheads
  (measured alone, times the slow-down of kinds alternating in a layer, fit.mix.*)
  and achieved fractions of peak (cost_models/calibration/ops.py); the fixed cost
  of one stage forward / backward call through the runtime's StageRunner, the loss on the
  last stage (fit.loss.*: fixed and per logits element) and zeroing gradients
  (fit.zero_grad.*), all used by the simulator (cost_models/calibration/stage.py), and what
  tensor parallelism adds besides its all-reduces (fit.tensor_wrapper.*,
  fit.tensor_embedding.*: planner.evaluate; fit.loss.vocab_*: the simulator); the runtime
  executor's own time per instruction (fit.executor.gap.* / .issue.* / .extra.*, from a
  reference pipeline run through it: cost_models/calibration/executor.py, simulator); the
  fixed cost of an optimizer step, per step and per parameter tensor
  (fit.optimizer.<kind>.per_step / .per_tensor);
  op curves (raw.curve.<family>.<size>.*: seconds per op of each family the models use at a
  ladder of sizes, cost_models/op_curves.py), which planner.evaluate prefers over the roofline
  for fp32 nodes of those families, and their in-layer factor from a probe transformer block
  (fit.curve_mix.*);
- communication (fit.comm.<op>.g<size>.alpha/.beta): `alpha + beta * n`
  least-squares fitted to each op and group size, weighting every size by its
  relative error (small and large messages count alike), plus fit.comm.wake
  in alpha: how much longer a small all-reduce takes right after computing
  than back to back (waiting for the slower rank and for the wake-up on a
  loaded machine); the links are the p2p fit (latency alpha, bandwidth 1 / beta);
  collectives are priced from the measured table itself (means per call, see
  calibrated.measured_collective); fit.comm.overlap_hidden: the share of an
  asynchronous all-reduce that compute running at the same time hides;
  fit.after_reduce.*: seconds per byte an optimizer step reading gradients, and zeroing
  them, cost beyond the same on a rank's own buffer right after an all-reduce went
  through them (the slowest rank's);
- raw.*: every measured number, so a fit can be checked or redone.

`meshplan calibrate` then trains a small probe model through the runtime for a few steps
(planner/app/calibrate_run.py, which needs the planner and codegen and so lives there) and
adds fit.in_run.*: how much longer forward and backward take in a traced run than the
per-op prices fitted here.

The planner and the simulator read the fits back through cost_models/calibrated.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

from cost_models import local_machine
from cost_models.calibration.ops import OpTiming, fit_compute
from cost_models.calibration.stage import fit_loss
from cost_models.hardware import Cluster, Device, Link
from cost_models.op_curves import fit_curve_mix
from cost_models.presets import CPU_ACTIVE_WATTS_PER_CORE, CPU_IDLE_WATTS_PER_CORE
from runtime.launch.launcher import free_port, local_mpiexec, mpiexec_args
from runtime.lifetime import Children
from runtime.vocab import Backend, DeviceKind, OpKind


class CalibrationError(ValueError):
    """The calibration runs could not be started or did not finish; the message says why and what to do."""


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(alpha s, beta s/byte) minimizing sum(((alpha + beta n - t) / t)^2) over (n bytes, t s) points.

    alpha is kept >= 0 and beta > 0 (refitting the other one when a bound binds).
    """
    pts = [(float(n), float(t)) for n, t in points if t > 0]
    if len(pts) < 2 or len({n for n, _ in pts}) < 2:
        raise ValueError(f"fit_alpha_beta needs at least two message sizes with positive times, got {points!r}")
    # Weighted least squares with weights 1/t^2: normal equations of a 2x2 system.
    w = [1.0 / (t * t) for _, t in pts]
    s1 = sum(w)
    sn = sum(wi * n for wi, (n, _) in zip(w, pts))
    snn = sum(wi * n * n for wi, (n, _) in zip(w, pts))
    st = sum(wi * t for wi, (_, t) in zip(w, pts))
    snt = sum(wi * n * t for wi, (n, t) in zip(w, pts))
    det = s1 * snn - sn * sn
    alpha = (st * snn - sn * snt) / det
    beta = (s1 * snt - sn * st) / det
    if alpha < 0:
        alpha, beta = 0.0, snt / snn
    if beta <= 0:
        big = max(n for n, _ in pts)
        beta = max(min(t for n, t in pts if n == big) / big * 1e-3, 1e-15)
        alpha = max(sum(wi * (t - beta * n) for wi, (n, t) in zip(w, pts)) / s1, 0.0)
    return alpha, beta


def run_workers(ranks: int, *, quick: bool = True, backend: str = Backend.GLOO.value, timeout: float = 300.0,
                progress: Callable[[str], None] | None = print) -> list[dict]:
    """Start `ranks` calibration processes on this machine and return each rank's results."""

    if ranks < 2:
        raise CalibrationError(f"calibration needs at least 2 ranks to measure communication, got {ranks}")
    with tempfile.TemporaryDirectory(prefix="meshplan-calibrate-") as tmp:
        port = free_port()
        base = [sys.executable, "-m", "cost_models.calibration.worker", "--world", str(ranks), "--port", str(port),
                "--out", tmp, "--backend", backend, "--timeout", str(timeout)] + ([] if quick else ["--full"])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with Children() as children:  # no calibration process outlives this one (runtime/lifetime.py)
            if backend == Backend.MPI:   # on loopback only, as meshplan run's MPI runs (runtime/launch/launcher.py)
                mpiexec, warning = local_mpiexec(mpiexec_args(ranks), env)
                if warning and progress:
                    progress(f"warning: {warning}")
                procs = [children.popen([*mpiexec, "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH",
                                         *base, "--rank", "0"], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, direct=False)]
            else:
                procs = [children.popen([*base, "--rank", str(r)], env=env, text=True, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT) for r in range(ranks)]
            lines: list[str] = []
            try:
                for line in procs[0].stdout:  # rank 0 reports progress line by line
                    lines.append(line.rstrip())
                    if progress:
                        progress(line.rstrip())
                deadline = time.monotonic() + timeout
                codes = [p.wait(timeout=max(deadline - time.monotonic(), 1.0)) for p in procs]
            except subprocess.TimeoutExpired:
                codes = [124]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        others = [p.stdout.read() for p in procs[1:]]
        if any(codes):
            tail = "\n".join((lines + [ln for o in others for ln in o.splitlines()])[-15:])
            raise CalibrationError(f"the calibration processes failed (exit status {codes}):\n{tail}\n"
                                   "check that this machine lets local processes talk over 127.0.0.1"
                                   + (" and that mpiexec works" if backend == Backend.MPI else ""))
        files = sorted(Path(tmp).glob("calib_rank_*.json"))
        if len(files) != ranks:
            raise CalibrationError(f"{len(files)} of {ranks} calibration ranks wrote results; run it again")
        return [json.loads(f.read_text()) for f in files]


def _comm_measurements(results: list[dict], comm_rows: list) -> dict[str, float]:
    """The communication entries of a calibrated cluster's measurements, in the order a file lists them:
    raw.comm.* (rank 0's `comm_rows`: op, group size, bytes, seconds), the wake-up after compute, the
    overlap an asynchronous all-reduce gets, the reads after a reduce, and fit.comm.<op>.g<g>.alpha/beta.
    CalibrationError when no p2p transfer was measured."""
    m: dict[str, float] = {}
    points: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for op, g, n, t in comm_rows:
        m[f"raw.comm.{op}.g{g}.{n}"] = t
        points[(op, g)].append((n, t))
    # A blocking transfer in a step comes right after computing: it waits for its own wake-up,
    # which back-to-back transfers hide. The measured excess of an 8-byte all-reduce after
    # compute over the back-to-back one is added to every alpha. The rank that arrives last
    # measures that alone; the others also wait for it, by how much slower it computed the
    # calibration's layers, which is noise of the moment (benchmarks/calibration_timing.py
    # shows its size) and, in a run, the simulator's to model from each rank's work. Each rank measures two windows seconds apart and keeps
    # the quieter (calibration.worker.main).
    sync = min(r["sync_all_reduce"] for r in results)
    m["raw.sync.all_reduce.g2.8"] = sync
    for i in (0, 1):  # each window's (min over ranks), kept for checking
        got = [r["rhythm_windows"][i][1] for r in results if len(r.get("rhythm_windows") or ()) > i]
        if got:
            m[f"raw.sync.all_reduce.g2.8.window{i}"] = min(got)
    back_to_back = sorted((n, t) for op, g, n, t in comm_rows if op == "all_reduce" and g == 2)
    wake = max(sync - back_to_back[0][1], 0.0) if back_to_back else 0.0
    m["fit.comm.wake"] = wake
    # How much of an asynchronous all-reduce the compute running meanwhile hides (the
    # communicator's threads compete with it for the cores): the simulator charges the rest
    # of an overlapped gradient collective to the backward it overlaps.
    overlaps = [r["overlap"] for r in results if r.get("overlap")]
    if overlaps:
        m["fit.comm.overlap_hidden"] = statistics.median(o[0] for o in overlaps)
        for i, what in enumerate(("hidden", "compute", "all_reduce", "overlapped")):
            m[f"raw.overlap.{what}"] = statistics.median(o[i] for o in overlaps)
    # Reading and zeroing gradients an all-reduce has just gone through (calibration.worker.after_reduce):
    # the slowest rank's figure, since the step waits for it.
    after = [r["after_reduce"] for r in results if r.get("after_reduce")]
    if after:
        m["fit.after_reduce.optimizer_per_byte"] = max(a[0] for a in after)
        m["fit.after_reduce.zero_grad_per_byte"] = max(a[1] for a in after)
        for i, what in enumerate(("optimizer", "zero_grad", "optimizer_own", "zero_grad_own")):
            m[f"raw.after_reduce.{what}"] = max(a[2 + i] for a in after)
    for (op, g), pts in sorted(points.items()):
        a, b = fit_alpha_beta(pts)
        m[f"fit.comm.{op}.g{g}.alpha"] = a + wake
        m[f"fit.comm.{op}.g{g}.beta"] = b
    if ("p2p", 2) not in points:
        raise CalibrationError("the calibration measured no p2p transfers; run it again")
    return m


def build_cluster(results: list[dict], *, backend: str = Backend.GLOO.value, quick: bool = True, seconds: float = 0.0,
                  name: str = "local-calibrated") -> Cluster:
    """The calibrated Cluster from run_workers' results (one node of len(results) devices)."""

    ranks = len(results)
    peak = statistics.median(r["peak_flops"] for r in results)
    bandwidth = statistics.median(r["memory_bandwidth"] for r in results)
    # Per kind and size, the median over ranks (they ran at once, under the same load).
    by_key: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in results:
        for t in r["ops"]:
            by_key[(t["kind"], t["size"])].append(t)
    timings = [OpTiming(OpKind(kind), size, statistics.median(t["forward"] for t in ts),
                        statistics.median(t["backward"] for t in ts), ts[0]["flops"], ts[0]["nbytes"])
               for (kind, size), ts in sorted(by_key.items())]
    block = tuple(statistics.median(r["block"][i] for r in results) for i in range(4))
    # Ops were timed unpreempted (medians); a rank computing in a step's rhythm gets only
    # `share` of a core on a loaded machine: compute rates times it, fixed costs divided by it.
    share = statistics.median(r["cpu_share"] for r in results)
    fit = fit_compute(timings, peak, bandwidth, block)
    fit = dataclasses.replace(fit, kernel_overhead=fit.kernel_overhead / share,
                              kind_overheads=tuple((k, f / share, b / share) for k, f, b in fit.kind_overheads),
                              call_forward=fit.call_forward / share, call_backward=fit.call_backward / share)
    raw_peak, raw_bandwidth = peak, bandwidth
    peak, bandwidth = peak * share, bandwidth * share
    comm_rows = next(r["comm"] for r in results if r["rank"] == 0)
    m: dict[str, float | int | str] = {
        "calibration.backend": backend, "calibration.mode": "quick" if quick else "full",
        "calibration.ranks": ranks, "calibration.seconds": round(seconds, 3),
        "calibration.load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else "n/a",
        "calibration.measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "raw.peak_fp32_flops": raw_peak, "raw.memory_bandwidth": raw_bandwidth, "fit.cpu_share": share,
        "fit.eff.matmul": fit.matmul, "fit.eff.conv": fit.conv, "fit.eff.memory": fit.memory,
        "fit.eff.kernel_overhead": fit.kernel_overhead,
        "fit.mix.forward": fit.mix_forward, "fit.mix.backward": fit.mix_backward,
        "fit.call.forward": fit.call_forward, "fit.call.backward": fit.call_backward,
        "raw.block.forward": block[0], "raw.block.backward": block[1],
        "raw.block.call_forward": block[2], "raw.block.call_backward": block[3],
    }
    for kind in sorted({k for r in results for k in r.get("optimizer", {})}):
        # a fixed cost, like the op overheads: divided by the CPU share
        m[f"fit.optimizer.{kind}.per_tensor"] = statistics.median(
            r["optimizer"][kind] for r in results if kind in r.get("optimizer", {})) / share
        fixed = [r["optimizer_fixed"][kind] for r in results if kind in r.get("optimizer_fixed", {})]
        if fixed:
            m[f"fit.optimizer.{kind}.per_step"] = statistics.median(fixed) / share
    m.update(_runtime_measurements([r["stage"] for r in results if r.get("stage")], share))
    m.update(_executor_measurements([r["executor"] for r in results if r.get("executor")], share))
    m.update(_curve_measurements(results, share, fit))
    for t in timings:
        m[f"raw.op.{t.kind}.{t.size}.forward"] = t.forward
        m[f"raw.op.{t.kind}.{t.size}.backward"] = t.backward
    for kind, f, b in fit.kind_overheads:
        m[f"fit.overhead.{kind}.forward"] = f
        m[f"fit.overhead.{kind}.backward"] = b
    m.update(_comm_measurements(results, comm_rows))
    p2p_alpha, p2p_beta = m["fit.comm.p2p.g2.alpha"], m["fit.comm.p2p.g2.beta"]
    link = Link(bandwidth=1.0 / p2p_beta, latency=p2p_alpha)
    cpus = local_machine._usable_cpus()
    share = min(1.0, cpus / ranks)
    device = Device(name=f"cpu process ({local_machine._cpu_model()})", kind=DeviceKind.CPU, peak_flops={"fp32": peak},
                    memory_bytes=local_machine._total_memory_bytes() // ranks, memory_bandwidth=bandwidth,
                    active_watts=CPU_ACTIVE_WATTS_PER_CORE * share, idle_watts=CPU_IDLE_WATTS_PER_CORE * share)
    source = (f"meshplan calibrate ({'quick' if quick else 'full'}, {backend}) on host "
              f"{local_machine.machine_key()['hostname']}: {ranks} rank processes at once, 1 thread each; "
              f"fits in measurements fit.*, raw numbers in raw.*; CPU power assumed")
    return Cluster(name=name, num_nodes=1, devices_per_node=ranks, device=device, intra_node=link,
                   inter_node=link, source=source, measurements=m)


def _runtime_measurements(stages: list[dict], share: float) -> dict[str, float]:
    """fit.call.*, fit.loss.*, fit.zero_grad.*, and fit.tensor_wrapper.*, fit.tensor_embedding.* and
    fit.loss.vocab_* (what tensor parallelism adds, fixed and per element) from the ranks'
    calibration.stage figures (medians over the ranks, divided by the CPU share like every fixed
    cost); {} when none were measured.

    The stage call measured through the runtime's StageRunner replaces the one derived from
    the layer chain (raw.block.call_*), which alternates chains and leaves every call's
    caches cold, so it costs several times what a stage run in a row does."""
    if not stages:
        return {}

    def med(get) -> float:
        return statistics.median(get(s) for s in stages) / share
    m = {"fit.call.forward": med(lambda s: s["call"][0]), "fit.call.backward": med(lambda s: s["call"][1]),
         "fit.zero_grad.per_tensor": med(lambda s: s["zero_grad"][0]),
         "fit.zero_grad.per_byte": med(lambda s: s["zero_grad"][1])}
    if all("tensor_wrapper" in s for s in stages):  # an older worker: the wrapper at one size
        m["fit.tensor_wrapper.forward"] = med(lambda s: s["tensor_wrapper"][0])
        m["fit.tensor_wrapper.backward"] = med(lambda s: s["tensor_wrapper"][1])
    if all("tensor_parallel" in s for s in stages):
        for part, prefix in (("wrapper", "tensor_wrapper."), ("vocab_embedding", "tensor_embedding."),
                             ("vocab_loss", "loss.vocab_")):
            m.update(_line_fits(f"fit.{prefix}", [s["tensor_parallel"][part] for s in stages], share,
                                raw=f"raw.tensor_parallel.{part}."))
    m.update(_line_fits("fit.loss.", [s["loss"] for s in stages], share, raw="raw.loss.cross_entropy."))
    return m


def _line_fits(prefix: str, per_rank: list[list[list[float]]], share: float, raw: str) -> dict[str, float]:
    """{prefix + "forward", prefix + "forward_per_element", prefix + "backward", ...} (s, s per
    element): calibration.stage.fit_loss through the ranks' median [elements, forward s, backward s]
    points, over the CPU share; and the points themselves as raw + "<elements>.forward" / ".backward"."""
    points = [[n, statistics.median(r[i][1] for r in per_rank), statistics.median(r[i][2] for r in per_rank)]
              for i, (n, _, _) in enumerate(per_rank[0])]
    m = {}
    for n, f, b in points:
        m[f"{raw}{int(n)}.forward"], m[f"{raw}{int(n)}.backward"] = f, b
    (f0, f1), (b0, b1) = fit_loss(points)
    m.update({f"{prefix}forward": f0 / share, f"{prefix}forward_per_element": f1 / share,
              f"{prefix}backward": b0 / share, f"{prefix}backward_per_element": b1 / share})
    return m


def _executor_measurements(runs: list[dict], share: float) -> dict[str, float]:
    """fit.executor.gap.<op>, .issue.<op> and .extra.<F|B> (s) from the ranks' calibration.executor
    figures: the median over the ranks that measured the op, divided by the CPU share like every
    fixed cost; {} when none were measured."""
    m = {}
    for part in ("gap", "issue", "extra"):
        for op in sorted({op for r in runs for op in r.get(part, {})}):
            got = [r[part][op] for r in runs if op in r.get(part, {})]
            m[f"fit.executor.{part}.{op}"] = statistics.median(got) / share
    return m


def _curve_measurements(results: list[dict], share: float, fit) -> dict[str, float]:
    """raw.curve.<family>.<size>.forward/.backward (median over ranks, divided by the CPU share like
    every unpreempted timing) and fit.curve_mix.* from the probe block; {} for results without curves."""
    if not all(r.get("curves") and r.get("probe") for r in results):
        return {}
    by: dict[tuple[str, float], list[tuple[float, float]]] = defaultdict(list)
    for r in results:
        for family, size, f, b in r["curves"]:
            by[(family, size)].append((f, b))
    m: dict[str, float] = {}
    curves: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
    for (family, size), fb in sorted(by.items()):
        f = statistics.median(x for x, _ in fb) / share
        b = statistics.median(y for _, y in fb) / share
        m[f"raw.curve.{family}.{int(size)}.forward"] = f
        m[f"raw.curve.{family}.{int(size)}.backward"] = b
        curves[family][0].append((size, f))
        curves[family][1].append((size, b))
    probe = tuple(statistics.median(r["probe"][i] for r in results) / share for i in (0, 1))
    view = next(((f, b) for k, f, b in fit.kind_overheads if k == OpKind.VIEW), (0.0, 0.0))
    mix = fit_curve_mix({k: (tuple(v[0]), tuple(v[1])) for k, v in curves.items()}, probe, view)
    m["raw.probe.forward"], m["raw.probe.backward"] = probe
    m["fit.curve_mix.forward"], m["fit.curve_mix.backward"] = mix
    return m


def calibrate(ranks: int | None = None, *, quick: bool = True, backend: str = Backend.GLOO.value, timeout: float = 300.0,
              progress: Callable[[str], None] | None = print) -> Cluster:
    """Measure this machine with `ranks` processes (default: one per usable CPU, at least 2)."""

    if backend == Backend.NCCL:
        raise CalibrationError("calibrate measures CPU processes over gloo or MPI; a GPU is calibrated on its own "
                               "(meshplan calibrate --device cuda: its op table, cost_models/calibration/"
                               "gpu_calibrate.py), and collectives between GPUs are not measured yet")
    n = ranks if ranks is not None else max(local_machine._usable_cpus(), 2)
    if progress:
        progress(f"calibrating with {n} rank processes ({'quick' if quick else 'full'}, {backend}) ...")
    t0 = time.perf_counter()
    results = run_workers(n, quick=quick, backend=backend, timeout=timeout, progress=progress)
    return build_cluster(results, backend=backend, quick=quick, seconds=time.perf_counter() - t0)


def for_world(cluster: Cluster, world: int) -> Cluster:
    """`cluster` resized to `world` devices on its one node (a calibrated local cluster used for a
    build of another size; the per-group-size fits still apply where they were measured)."""
    if cluster.num_nodes != 1:
        if cluster.num_devices < world:
            raise ValueError(f"cluster {cluster.name!r} has {cluster.num_devices} devices but the build needs {world}")
        return cluster
    return dataclasses.replace(cluster, devices_per_node=world)

