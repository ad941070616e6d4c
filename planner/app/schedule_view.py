"""Schedules as plain data for the pictures: records of what each rank did, and the
pipeline schedule predicted from a plan's per-stage times (GPipe, 1F1B, interleaved).

A schedule is a sequence of :class:`ScheduleRecord` (rank, label, kind, start, end),
saved and loaded as JSON; measured runtime timelines convert to it with :func:`as_records`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cost_models.mesh_axes import rank_at, rank_coords
from planner.app.figure_kit import KINDS, _check_plan
from runtime.documents import read_document
from runtime.vocab import Schedule

if TYPE_CHECKING:  # only for annotations; nothing is imported at run time
    from planner.plan import Plan

# ---------------------------------------------------------------------------
# Schedule records


@dataclass(frozen=True)
class ScheduleRecord:
    """One thing one rank did (or is predicted to do) during a step.

    Attributes:
        rank: global rank (row-major over the mesh pipeline, data, tensor).
        label: what it was, e.g. "F s1 m3", "B s0 m2", "SEND act s1->s2", "ALLREDUCE grads".
        kind: one of KINDS; decides the colour.
        start, end: seconds (any common origin; figures show time since the earliest start).
    """

    rank: int
    label: str
    kind: str
    start: float
    end: float

    def __post_init__(self) -> None:
        what = f"schedule record {self.label!r}" if isinstance(self.label, str) else "schedule record"
        if isinstance(self.rank, bool) or not isinstance(self.rank, numbers.Integral) or self.rank < 0:
            raise ValueError(f"{what}: rank must be an integer >= 0, got {self.rank!r}")
        if not isinstance(self.label, str):
            raise ValueError(f"schedule record on rank {self.rank}: label must be a string, got {self.label!r}")
        if self.kind not in KINDS:
            raise ValueError(f"{what} on rank {self.rank}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        for name in ("start", "end"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(f"{what} on rank {self.rank}: {name} must be a finite number of seconds, "
                                 f"got {v!r}")
        if self.end < self.start:
            raise ValueError(f"{what} on rank {self.rank}: end {self.end!r} s is before start {self.start!r} s; "
                             f"records must have end >= start")
        object.__setattr__(self, "rank", int(self.rank))
        object.__setattr__(self, "start", float(self.start))
        object.__setattr__(self, "end", float(self.end))

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def as_records(timeline: Iterable[Any], name: str = "timeline") -> list[ScheduleRecord]:
    """Records from ScheduleRecords, dicts, 5-tuples (rank, label, kind, start, end) or objects
    with those attributes. Raises ValueError naming the record at fault."""
    if isinstance(timeline, (str, bytes, Mapping)) or not isinstance(timeline, Iterable):
        raise ValueError(f"{name} must be a sequence of schedule records (rank, label, kind, start, end), "
                         f"got {type(timeline).__name__}")
    fields = ("rank", "label", "kind", "start", "end")
    out = []
    for k, rec in enumerate(timeline):
        try:
            if isinstance(rec, ScheduleRecord):
                out.append(rec)
            elif isinstance(rec, Mapping):
                missing = [f for f in fields if f not in rec]
                if missing:
                    raise ValueError(f"missing field(s) {missing}")
                out.append(ScheduleRecord(**{f: rec[f] for f in fields}))
            elif isinstance(rec, (tuple, list)):
                if len(rec) != 5:
                    raise ValueError(f"expected 5 values (rank, label, kind, start, end), got {len(rec)}")
                out.append(ScheduleRecord(*rec))
            elif all(hasattr(rec, f) for f in fields):
                out.append(ScheduleRecord(**{f: getattr(rec, f) for f in fields}))
            else:
                raise ValueError(f"cannot read a record from {type(rec).__name__}")
        except ValueError as e:
            raise ValueError(f"{name} record {k}: {e}") from None
    return out


def save_timeline(records: Iterable[Any], path: str | os.PathLike) -> Path:
    """Write records as a JSON list of {rank, label, kind, start, end}."""
    p = Path(path)
    p.write_text(json.dumps([r.to_dict() for r in as_records(records)], indent=1))
    return p


def load_timeline(path: str | os.PathLike) -> list[ScheduleRecord]:
    """Read a JSON list of records (or {"records": [...]}) written by save_timeline."""
    data = read_document(path, "timeline file", top=(list, dict))
    if "records" in data:
        data = data["records"]
    return as_records(data, name=f"timeline file {Path(path)}")


# ---------------------------------------------------------------------------
# Predicted schedule


def schedule_orders(schedule: str, pipeline: int, micro_batches: int,
                    virtual_stages: int = 1) -> list[list[tuple[str, int, int]]]:
    """Per pipeline position, the ordered ops ("F"|"B", stage, micro-batch) it runs.

    Stage s runs on position s % pipeline. GPipe: all forwards, then all
    backwards. 1F1B: pipeline-1-i warm-up forwards, then one forward / one
    backward, then the remaining backwards. Interleaved (Megatron-LM): micro-batches
    go in groups of `pipeline` through chunk 0, 1, ..., v-1 (backwards through
    v-1 .. 0), with (p-1-i)*2 + (v-1)*p warm-up forwards. When micro_batches is not
    a multiple of pipeline the last group is partial and that warm-up can deadlock;
    the warm-up of the positions that would wait forever grows until none does.
    """
    p, m, v = pipeline, micro_batches, virtual_stages
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline, micro_batches and virtual_stages must be >= 1, got {p}, {m}, {v}")
    if schedule not in tuple(Schedule):
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(Schedule)}")
    if schedule == Schedule.GPIPE:
        return [[("F", c * p + i, j) for c in range(v) for j in range(m)]
                + [("B", c * p + i, j) for c in reversed(range(v)) for j in range(m)] for i in range(p)]
    if schedule == Schedule.ONE_F_ONE_B or v == 1:
        return [_one_f_one_b([("F", i, j) for j in range(m)], [("B", i, j) for j in range(m)], min(p - 1 - i, m))
                for i in range(p)]
    groups = [range(g, min(g + p, m)) for g in range(0, m, p)]
    fwd = [[("F", c * p + i, j) for grp in groups for c in range(v) for j in grp] for i in range(p)]
    bwd = [[("B", c * p + i, j) for grp in groups for c in reversed(range(v)) for j in grp] for i in range(p)]
    warmup = [min((p - 1 - i) * 2 + (v - 1) * p, m * v) for i in range(p)]
    while True:
        orders = [_one_f_one_b(fwd[i], bwd[i], warmup[i]) for i in range(p)]
        stuck = _stuck_on_backward(orders, p * v)
        if not stuck:
            return orders
        for i in stuck:  # one more forward before the first backward breaks the wait
            assert warmup[i] < m * v, "all-forwards-first cannot deadlock"
            warmup[i] += 1


def _one_f_one_b(fwd: list, bwd: list, warmup: int) -> list:
    ops = fwd[:warmup]
    for k in range(len(fwd) - warmup):
        ops += [fwd[warmup + k], bwd[k]]
    return ops + bwd[len(fwd) - warmup:]


def _deps(op: str, s: int, j: int, num_stages: int) -> list[tuple[str, int, int]]:
    """F(s, j) needs F(s-1, j); B(s, j) needs F(s, j) and B(s+1, j) (none after the last stage)."""
    if op == "F":
        return [("F", s - 1, j)] if s > 0 else []
    return [("F", s, j)] + ([("B", s + 1, j)] if s < num_stages - 1 else [])


def _stuck_on_backward(orders: Sequence[Sequence[tuple[str, int, int]]], num_stages: int) -> list[int]:
    """Positions that wait forever on a backward (empty: the orders run to the end)."""
    done: set = set()
    ptr = [0] * len(orders)
    progressed = True
    while progressed:
        progressed = False
        for i, ops in enumerate(orders):
            while ptr[i] < len(ops) and all(d in done for d in _deps(*ops[ptr[i]], num_stages)):
                done.add(ops[ptr[i]])
                ptr[i] += 1
                progressed = True
    return [i for i, ops in enumerate(orders) if ptr[i] < len(ops) and ops[ptr[i]][0] == "B"]


def simulate_schedule(orders: Sequence[Sequence[tuple[str, int, int]]], forward: Sequence[float],
                      backward: Sequence[float]) -> list[tuple[int, str, int, int, float, float]]:
    """Run per-position op lists with zero-cost p2p: (position, op, stage, mb, start, end) per op.

    An op starts when its position is free and its inputs are done: F(s, j) after
    F(s-1, j); B(s, j) after F(s, j) and B(s+1, j). Raises ValueError if the
    orders deadlock.
    """
    num_stages = len(forward)
    if len(backward) != num_stages:
        raise ValueError(f"{num_stages} forward times but {len(backward)} backward times")
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(orders)
    ptr = [0] * len(orders)
    out = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i, ops in enumerate(orders):
            while ptr[i] < len(ops):
                op, s, j = ops[ptr[i]]
                deps = _deps(op, s, j, num_stages)
                if any(d not in done for d in deps):
                    break
                start = max([free[i]] + [done[d] for d in deps])
                end = start + (forward[s] if op == "F" else backward[s])
                done[(op, s, j)] = free[i] = end
                out.append((i, op, s, j, start, end))
                ptr[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = {i: ops[ptr[i]] for i, ops in enumerate(orders) if ptr[i] < len(ops)}
            raise ValueError(f"the schedule deadlocks: positions wait on {waiting}")
    return out


def predicted_schedule(plan: "Plan", *, max_micro_batches: int | None = None,
                       ranks: Iterable[int] | None = None) -> list[ScheduleRecord]:
    """The plan's pipeline schedule for one step, simulated per rank.

    Forward/backward times per micro-batch come from `plan.prediction.stages`
    (backward includes recompute and tensor-parallel collectives); p2p costs
    nothing here, so the chart shows the schedule's shape and its bubble.

    Args:
        max_micro_batches: simulate at most this many micro-batches (None: all
            `prediction.num_micro_batches`).
        ranks: the ranks to emit; each follows the schedule of its pipe
            coordinate. Default: the pipeline of data 0, tensor 0.
    Returns records labelled "F s<stage> m<micro-batch>" / "B s.. m..", sorted by start.
    """
    _check_plan(plan)
    cfg, pred = plan.config, plan.prediction
    mesh = cfg.mesh
    m = pred.num_micro_batches
    if max_micro_batches is not None:
        if isinstance(max_micro_batches, bool) or not isinstance(max_micro_batches, int) or max_micro_batches < 1:
            raise ValueError(f"max_micro_batches must be a positive integer, got {max_micro_batches!r}")
        m = min(m, max_micro_batches)
    if len(pred.stages) != cfg.num_stages:
        raise ValueError(f"plan has {len(pred.stages)} stage predictions but its config has "
                         f"{cfg.num_stages} stages; make the plan again")
    orders = schedule_orders(cfg.schedule, cfg.pipeline, m, cfg.virtual_stages)
    ops = simulate_schedule(orders, [s.forward for s in pred.stages], [s.backward for s in pred.stages])
    if ranks is None:
        rank_list = [rank_at(i, 0, 0, mesh) for i in range(cfg.pipeline)]
    else:
        rank_list = []
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 0 <= r < cfg.num_devices:
                raise ValueError(f"rank {r!r} is not a rank of this plan (0..{cfg.num_devices - 1})")
            rank_list.append(int(r))
    by_pos: dict[int, list[int]] = {}
    for r in rank_list:
        by_pos.setdefault(rank_coords(r, mesh)[0], []).append(r)
    out = [ScheduleRecord(r, f"{op} s{s} m{j}", "forward" if op == "F" else "backward", start, end)
           for i, op, s, j, start, end in ops for r in by_pos.get(i, ())]
    return sorted(out, key=lambda rec: (rec.start, rec.rank))


