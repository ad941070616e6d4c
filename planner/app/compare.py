"""`meshplan compare BUILD_DIR`: the simulator's prediction set beside what a traced run measured.

    result = compare_build("build", Cluster.load("cluster.yaml"))
    print(result.report())

The prediction is the simulator (cost_models/simulate.py) run on the same
per-rank Programs the build executed, with compute costs from planner.evaluate
on the given (calibrated) cluster: the plan's configuration with its stage
boundaries pinned, its tensor-parallel layout, and the optimizer the build
trains with (the planner's default prices Adam's state). The measurement is
the run's merged Timeline (build/timeline.json, written by `meshplan run`, or by rank 0 of a run
the launch scripts started, on one node or several)
and, with `meshplan run --track-memory`, each rank's measured peak memory.

The prediction's costs are planner/app/build_costs.py's; reading a build never imports the
model's code.

Step time: the median over the measured steps after the first (warm-up),
leaving out the one whose memory was counted, against the simulated step. Per instruction
kind: on every rank, the summed duration of that kind's instructions in a
step (median over steps), totalled over ranks, measured and predicted (a
predicted SEND/RECV ends no earlier than its WAIT, as the trace records it).

Which clock measured them: on a CPU the host's perf_counter around each instruction; on a GPU
CUDA events on the device (runtime/execute/device_clock.py), since the host only queues the kernels
(its backward is the time to queue it, and the next synchronizing instruction waits for the
device). A GPU run's host intervals are shown beside the device ones: the host's step, each
kind's host time, and how far the device ran behind the host (the host's lead): a step whose
device never fell more than HOST_BOUND_LEAD of it behind the host had no work queued ahead, so
the host's launches and syncs bounded it (host-bound); otherwise the device did (device-bound).
Memory: per rank, the predicted footprint of the device it is (parameters,
gradients, optimizer state, activations kept, buffers; see build_costs.for_runtime)
against the measured peak.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from cost_models.calibrated import measured_collective
from cost_models.hardware import Cluster
from cost_models.simulate import simulate_steady
from planner.app.build_costs import CompareError, predicted_costs
from planner.app.schedule_view import ScheduleRecord
from planner.app.visualize import save_figure, schedule_figure, style
from runtime.program.instr_set import Op
from runtime.program.trace import HOST_TRACKS, INSTRUCTION_TRACKS, Event, Timeline
from runtime.vocab import Clock, Collective, Track
from runtime.documents import read_document

_KIND_OF_OP = {"F": "forward", "B": "backward", "SEND": "send", "RECV": "recv", "ALLREDUCE": "collective",
               "ALLGATHER": "collective", "REDUCESCATTER": "collective", "BROADCAST": "collective",
               "STEP": "optimizer", "ZERO_GRAD": "other", "WAIT": "other"}
# A run whose probe all-reduce took more than this many times longer or shorter than at
# calibration ran on a machine in another state (compare warns; benchmarks/accuracy.py says so).
TRANSFER_DRIFT = 1.5
# A GPU step whose device never ran more than this share of the step behind the host is host-bound:
# the device had no work queued ahead and waited for each launch. (A heuristic: a device-bound
# step's backward alone typically leaves the device a third of the step behind the host.)
HOST_BOUND_LEAD = 0.1
_CLOCK_TEXT = {Clock.HOST: "host perf_counter around each instruction",
               Clock.CUDA: "CUDA events on the device (the host's times beside them)"}


@dataclass(frozen=True)
class KindError:
    """One instruction kind: seconds per step summed over ranks, measured (on the run's clock) and
    predicted; `host`: the same instructions on the host's clock (a GPU run's host track; None on
    a CPU run, whose one clock is the host's)."""

    op: str
    measured: float
    predicted: float
    host: float | None = None

    @property
    def error(self) -> float | None:
        return (self.predicted - self.measured) / self.measured if self.measured > 0 else None


@dataclass(frozen=True)
class RankMemory:
    rank: int
    measured: int | None     # bytes, peak of the tracked step (None: not measured)
    predicted: float         # bytes

    @property
    def error(self) -> float | None:
        return (self.predicted - self.measured) / self.measured if self.measured else None


@dataclass(frozen=True)
class Comparison:
    """Predicted versus measured for one traced build. Seconds and bytes."""

    build: str
    cluster: str
    measured_step: float
    measured_steps: tuple[float, ...]
    typical_step: int          # the measured step whose time is nearest the median (drawn)
    predicted_step: float
    analytic_step: float
    kinds: tuple[KindError, ...]
    memory: tuple[RankMemory, ...]
    # (s in this run, s at calibration) of an all-reduce of 1 MiB over all ranks, when the run
    # was started with --probe-comm and the cluster was calibrated for that group size
    transfer: tuple[float, float] | None = None
    clock: str = Clock.HOST    # what measured `measured_step` and the kinds (runtime.vocab.Clock)
    host_step: float | None = None   # a GPU run: the median step on the host's clock (same steps)
    host_lead: float | None = None   # a GPU run: the median over steps of how far the device ran behind the host

    @property
    def host_bound(self) -> bool | None:
        """Whether the device never ran far behind the host (HOST_BOUND_LEAD of the step): the host's
        launches and syncs set the pace. None without a host timeline (a CPU run)."""
        if self.host_lead is None:
            return None
        return self.host_lead <= HOST_BOUND_LEAD * self.measured_step

    @property
    def transfer_ratio(self) -> float | None:
        """How much longer the probe all-reduce took in the run than at calibration (None if unknown)."""
        return self.transfer[0] / self.transfer[1] if self.transfer and self.transfer[1] > 0 else None

    @property
    def transfer_held(self) -> bool | None:
        """Whether the run moved data at the calibrated speed (within TRANSFER_DRIFT); None if unknown."""
        ratio = self.transfer_ratio
        return None if ratio is None else 1 / TRANSFER_DRIFT <= ratio <= TRANSFER_DRIFT

    @property
    def step_error(self) -> float:
        return (self.predicted_step - self.measured_step) / self.measured_step

    def report(self) -> str:
        ms = 1e3
        lines = [f"compare {self.build} on cluster {self.cluster!r}",
                 f"  step time: predicted {self.predicted_step * ms:.3f} ms (simulated; analytic "
                 f"{self.analytic_step * ms:.3f} ms), measured {self.measured_step * ms:.3f} ms (median of "
                 f"{len(self.measured_steps)} steps): error {self.step_error:+.1%}",
                 f"  clock: {_CLOCK_TEXT.get(self.clock, self.clock)}"]
        if self.host_step is not None:
            lead = self.host_lead or 0.0
            lines.append(f"  host timeline: {self.host_step * ms:.3f} ms per step; the device ran at most "
                         f"{lead * ms:.3f} ms behind the host ({lead / self.measured_step:.0%} of the step): "
                         + ("host-bound (the device waited for the host's launches and syncs)" if self.host_bound
                            else "device-bound"))
        host = any(k.host is not None for k in self.kinds)
        lines.append(f"  {'kind':<14}{'measured ms':>12}{'predicted ms':>14}{'error':>9}"
                     + (f"{'host ms':>10}" if host else "") + "   (per step, summed over ranks)")
        for k in self.kinds:
            err = f"{k.error:+.0%}" if k.error is not None else "n/a"
            lines.append(f"  {k.op:<14}{k.measured * ms:>12.3f}{k.predicted * ms:>14.3f}{err:>9}"
                         + (f"{k.host * ms:>10.3f}" if k.host is not None else ""))
        ratio = self.transfer_ratio
        if ratio is not None:
            lines.append(f"  machine state: a 1 MiB all-reduce over all ranks took {self.transfer[0] * ms:.3f} ms in "
                         f"this run, {self.transfer[1] * ms:.3f} ms at calibration (x{ratio:.2f})")
            if not self.transfer_held:
                lines.append("  warning: the machine moved data at a different speed than when it was calibrated; "
                             "calibrate again right before the run (meshplan calibrate) and compare again")
        if self.memory:
            lines.append(f"  {'rank':<6}{'measured MiB':>14}{'predicted MiB':>15}{'error':>9}   (peak memory)")
            for m in self.memory:
                meas = f"{m.measured / 2**20:.3f}" if m.measured is not None else "not measured"
                err = f"{m.error:+.1%}" if m.error is not None else "n/a"
                lines.append(f"  {m.rank:<6}{meas:>14}{m.predicted / 2**20:>15.3f}{err:>9}")
        return "\n".join(lines)


def compare_build(build: str | Path, cluster: "Cluster", *, skip_steps: int = 1) -> tuple[Comparison, "Timeline",
                                                                                           "Timeline", object]:
    """(Comparison, predicted Timeline, measured Timeline, plan priced on `cluster`) of a traced build."""
    build = Path(build)
    plan, pred, costs, progs, cluster = predicted_costs(build, cluster)   # the build's files first: a damaged
    measured, kept = measured_steps(build, skip_steps=skip_steps)          # build is named as such
    # the measured steps compared are steps after the first: the steady state, where ranks do
    # not start a step together
    predicted = simulate_steady(progs, costs, cluster)
    memory = _memory_table(build, progs, pred)
    cmp = measured_comparison(measured, kept, as_observed(predicted, progs), build=str(build), cluster=cluster.name,
                              analytic_step=pred.step_time, memory=memory,
                              transfer=_transfer(build, cluster, len(progs)))
    return cmp, predicted, measured, plan


def measured_comparison(measured: "Timeline", kept: dict[int, float], predicted: "Timeline", **fields) -> Comparison:
    """The Comparison of a measured Timeline's steps `kept` ({step: s}, measured_steps) with a predicted
    one-step Timeline: the step times, the per-kind table, and on a GPU run the host's view beside the
    device's. `fields`: the rest of Comparison's fields (build, cluster, analytic_step, memory, transfer)."""
    steps = sorted(kept)
    median = statistics.median(kept.values())
    host_step = host_lead = None
    if measured.has_host_track:
        host_steps = measured.step_times(HOST_TRACKS)
        host_step = statistics.median(host_steps.get(s, 0.0) for s in steps)
        host_lead = statistics.median(_device_lag(measured, s) for s in steps)
    return Comparison(measured_step=median, measured_steps=tuple(kept.values()),
                      typical_step=min(kept, key=lambda s: abs(kept[s] - median)),
                      predicted_step=predicted.step_times()[0], kinds=_kind_table(measured, predicted, steps),
                      clock=measured.clock, host_step=host_step, host_lead=host_lead, **fields)


def _device_lag(tl: "Timeline", step: int) -> float:
    """The most seconds a blocking instruction of `step` ended on the device after it ended on the host
    (any rank): how far the host had run ahead of the device's compute stream. 0 without a host track."""
    host = {(e.rank, e.index): e.end for e in tl.events if e.step == step and e.track == Track.HOST}
    return max((e.end - host[(e.rank, e.index)] for e in tl.events
                if e.step == step and e.track == Track.COMPUTE and (e.rank, e.index) in host), default=0.0)


def _transfer(build: Path, cluster, world: int) -> tuple[float, float] | None:
    """(run s, calibrated s) of the --probe-comm all-reduce, from rank 0's run record and the
    cluster's measured table (without the wake-up it adds for transfers after compute)."""
    try:
        probe = json.loads((build / "run" / "rank_0000.json").read_text()).get("probe")
    except (OSError, ValueError):
        return None
    if not probe or probe.get("seconds") is None:
        return None
    calibrated = measured_collective(cluster, Collective.ALL_REDUCE, world, probe["all_reduce_bytes"], wake=False)
    return (float(probe["seconds"]), calibrated) if calibrated else None


def measured_steps(build: str | Path, *, skip_steps: int = 1) -> tuple["Timeline", dict[int, float]]:
    """(the traced run's Timeline, {step: seconds} of the steps compared): the first `skip_steps`
    (warm-up) and the step whose memory was counted (slowed down by counting) are left out."""
    build = Path(build)
    if not (build / "timeline.json").is_file():
        raise CompareError(f"{build} has no timeline.json: run it first with `meshplan run {build} --steps 5` "
                           "or one of its launch scripts with --out on a directory every node shares "
                           "(tracing is on unless --no-trace)")
    measured = Timeline.load(build / "timeline.json")
    steps = measured.step_times()
    counted = _memory_steps(build)
    kept = {s: t for s, t in steps.items() if s >= min(steps, default=0) + skip_steps and s not in counted}
    if not kept:
        raise CompareError(f"{build}/timeline.json has {len(steps)} step(s); the first is warm-up and the one "
                           f"whose memory was counted is slow: run more (meshplan run {build} --steps 6)")
    return measured, kept


def _memory_steps(build: Path) -> set[int]:
    steps = set()
    for f in (build / "run").glob("rank_*.json"):
        mem = read_document(f, "run record", error=CompareError).get("memory")
        if mem and "step" in mem:
            steps.add(int(mem["step"]))
    return steps


def _per_step_kind(tl: "Timeline", steps: list[int],
                   tracks: tuple[str, ...] = INSTRUCTION_TRACKS) -> dict[str, float]:
    """op -> median over `steps` of the seconds of that op's instructions on `tracks` (default: on the
    run's clock), summed over ranks."""
    out: dict[str, list[float]] = {}
    for s in steps:
        tot: dict[str, float] = {}
        for e in tl.events:
            if e.step == s and e.track in tracks:
                tot[e.op] = tot.get(e.op, 0.0) + e.duration
        for op, t in tot.items():
            out.setdefault(op, []).append(t)
    return {op: statistics.median(v + [0.0] * (len(steps) - len(v))) for op, v in out.items()}


def as_observed(predicted: "Timeline", programs: dict) -> "Timeline":
    """The predicted Timeline as the runtime's trace would show it: a SEND's or RECV's
    completion is seen when the rank WAITs on it (gloo and MPI report point-to-point
    completion only then), so its event ends no earlier than that WAIT begins."""
    wait_start: dict[tuple[int, int], float] = {}
    for e in predicted.events:
        if e.op == Op.WAIT:
            ins = programs[e.rank].instrs[e.index]
            wait_start[(e.rank, ins.handle)] = e.start
    out = []
    for e in predicted.events:
        if e.op in (Op.SEND, Op.RECV):
            seen = wait_start.get((e.rank, programs[e.rank].instrs[e.index].handle))
            if seen is not None and seen > e.end:
                e = Event(e.rank, e.step, e.index, e.name, e.op, e.start, seen, e.track)
        out.append(e)
    return Timeline(tuple(out), predicted.source)


def _kind_table(measured: "Timeline", predicted: "Timeline", steps: list[int]) -> tuple[KindError, ...]:
    meas = _per_step_kind(measured, steps)
    host = _per_step_kind(measured, steps, HOST_TRACKS) if measured.has_host_track else None
    pred = _per_step_kind(predicted, [0])
    order = list(_KIND_OF_OP)
    ops = sorted(set(meas) | set(pred), key=lambda o: order.index(o) if o in order else len(order))
    return tuple(KindError(op, meas.get(op, 0.0), pred.get(op, 0.0), None if host is None else host.get(op, 0.0))
                 for op in ops)


def _memory_table(build: Path, progs: dict, pred) -> tuple[RankMemory, ...]:
    # allocated bytes, as the runtime measures them (the fragmentation margin is the reserve beyond them)
    by_stage = {s.index: s.memory.allocated for s in pred.stages}
    out = []
    for r, prog in sorted(progs.items()):
        f = build / "run" / f"rank_{r:04d}.json"
        measured = None
        if f.is_file():
            mem = read_document(f, "run record", error=CompareError).get("memory")
            measured = int(mem["peak"]) if mem else None
        # A device's footprint is the same for each of its stages (evaluate prices it per device).
        out.append(RankMemory(r, measured, max(by_stage[s] for s in prog.stages)))
    return tuple(out)


def records(tl: "Timeline") -> list:
    """The Timeline's compute-track events as schedule records for planner.app.visualize: forward,
    backward, optimizer. WAITs (idle) and the asynchronous transfers, which would cover the
    chart from issue to completion, are left out (trace.json shows them in Perfetto)."""
    return [ScheduleRecord(e.rank, e.name, _KIND_OF_OP.get(e.op, "other"), e.start, e.end)
            for e in tl.events if e.track == Track.COMPUTE and e.op != Op.WAIT]


def draw(plan, predicted: "Timeline", measured: "Timeline", step: int, out_stem: str | Path) -> list[Path]:
    """Predicted and measured schedules of one step side by side: out_stem.png and .svg."""
    one = measured.for_step(step)
    if not one.events:
        raise CompareError(f"the measured timeline has no step {step}")
    paths = []
    with style():
        fig = schedule_figure(plan, records(predicted), records(one))
        for fmt in ("png", "svg"):
            p = Path(f"{out_stem}.{fmt}")
            save_figure(fig, p, fmt)
            paths.append(p)
    return paths
