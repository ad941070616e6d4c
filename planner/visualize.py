"""Pictures that explain a plan: device mesh, memory, time, alternatives, pipeline schedule.

    paths = planner.visualize(plan, "out/")                     # out/mesh.png, out/mesh.svg, ...
    paths = visualize(plan, "out/gpt", timeline=measured_pred, measured=measured)   # out/gpt_mesh.png ...

Five figures, each written as PNG and SVG (SVG keeps its text as text, so it
can be searched and is small):

=============  ===============================================================
mesh           one cell per device (rank), inside a box per node, coloured by
               pipeline stage, labelled ``r<rank>`` and ``(pipe, data, tensor)``
memory         stacked bars per pipeline stage (one device's footprint) against
               the device capacity
time           the step time split into its components (stacked bar + a bar per
               component with its share)
alternatives   the runners-up the search priced, their step time vs the chosen
               plan, whether they fit and why they lost
schedule       a Gantt chart per rank of one step's pipeline schedule; predicted
               (simulated from the plan) and, when given, measured side by side
=============  ===============================================================

Schedules are plain data: a sequence of :class:`ScheduleRecord` (rank, label,
kind, start, end). :func:`predicted_schedule` simulates GPipe, 1F1B and the
interleaved 1F1B schedule from the plan's per-stage forward/backward times.

Nothing happens at import time: matplotlib is imported inside the functions,
and figures are drawn on an explicitly attached Agg canvas (non-interactive),
so the process-wide pyplot backend is never touched.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only for annotations; nothing is imported at run time
    from matplotlib.figure import Figure

    from planner.plan import Plan

KINDS = ("forward", "backward", "recompute", "send", "recv", "collective", "optimizer", "other")
FIGURES = ("mesh", "memory", "time", "alternatives", "schedule")
FORMATS = ("png", "svg")
MAX_MESH_DEVICES = 256          # above this the mesh shows one data-parallel replica
DEFAULT_MAX_MICRO_BATCHES = 8   # micro-batches drawn in a predicted schedule on its own
DPI = 150

# Colours mean the same thing in every figure (forward is always blue, ...).
KIND_COLORS = {
    "forward": "#4C72B0", "backward": "#DD8452", "recompute": "#8172B3", "send": "#55A868",
    "recv": "#64B5CD", "collective": "#C44E52", "optimizer": "#937860", "other": "#8C8C8C",
}
TIME_COLORS = {
    "forward": KIND_COLORS["forward"], "backward": KIND_COLORS["backward"],
    "recompute": KIND_COLORS["recompute"], "tensor_comm": "#C44E52", "pipeline_comm": "#55A868",
    "bubble": "#CFCFCF", "data_comm": "#E8A0A2", "zero_comm": "#8E2F32", "optimizer": "#937860",
}
TIME_NAMES = {
    "forward": "forward", "backward": "backward", "recompute": "recompute",
    "tensor_comm": "tensor-parallel comm", "pipeline_comm": "pipeline p2p",
    "bubble": "pipeline bubble", "data_comm": "data-parallel sync", "zero_comm": "ZeRO comm",
    "optimizer": "optimizer step",
}
MEMORY_COLORS = {
    "parameters": "#4C72B0", "gradients": "#DD8452", "optimizer": "#55A868",
    "activations": "#8172B3", "comm_buffers": "#C44E52", "temporary": "#8C8C8C",
}
MEMORY_NAMES = {
    "parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state",
    "activations": "activations", "comm_buffers": "comm buffers", "temporary": "temporary",
}
IDLE_COLOR = "#F2F2F2"

_IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".html", ".htm")


# ---------------------------------------------------------------------------
# Schedule records


@dataclass(frozen=True)
class ScheduleRecord:
    """One thing one rank did (or is predicted to do) during a step.

    Attributes:
        rank: global rank (row-major over the mesh pipe, data, tensor).
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
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"timeline file {p} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"timeline file {p} is not valid JSON: {e}") from None
    if isinstance(data, Mapping) and "records" in data:
        data = data["records"]
    return as_records(data, name=f"timeline file {p}")


# ---------------------------------------------------------------------------
# Predicted schedule


def rank_coords(rank: int, mesh: Mapping[str, int]) -> tuple[int, int, int]:
    """(pipe, data, tensor) coordinates of a rank; ranks are row-major, tensor fastest."""
    d, t = mesh["data"], mesh["tensor"]
    return rank // (d * t), (rank // t) % d, rank % t


def _rank_of(pipe: int, data: int, tensor: int, mesh: Mapping[str, int]) -> int:
    return (pipe * mesh["data"] + data) * mesh["tensor"] + tensor


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
    if schedule not in ("gpipe", "1f1b", "interleaved"):
        raise ValueError(f"unknown schedule {schedule!r}; known: gpipe, 1f1b, interleaved")
    if schedule == "gpipe":
        return [[("F", c * p + i, j) for c in range(v) for j in range(m)]
                + [("B", c * p + i, j) for c in reversed(range(v)) for j in range(m)] for i in range(p)]
    if schedule == "1f1b" or v == 1:
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
        rank_list = [_rank_of(i, 0, 0, mesh) for i in range(cfg.pipeline)]
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


# ---------------------------------------------------------------------------
# Small helpers: units, text, figures


def _check_plan(plan: Any) -> None:
    from planner.plan import Plan

    if not isinstance(plan, Plan):
        raise ValueError(f"expected a planner.Plan, got {type(plan).__name__}; "
                         f"make one with planner.optimize / planner.make_plan or Plan.load('plan.json')")


def _time_unit(seconds: float) -> tuple[str, float]:
    s = abs(seconds)
    if s >= 1.0:
        return "s", 1.0
    if s >= 1e-3:
        return "ms", 1e-3
    return "µs", 1e-6


def _memory_unit(nbytes: float) -> tuple[str, float]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return unit, float(size)
    return "B", 1.0


def _num(v: float) -> str:
    """3 significant digits, no exponent for everyday magnitudes: 0.0123, 1.23, 123, 12,345."""
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1000:
        return f"{v:,.0f}"
    digits = max(0, 2 - int(math.floor(math.log10(a))))
    return f"{v:.{digits}f}"


def _fmt_time(seconds: float) -> str:
    unit, size = _time_unit(seconds)
    return f"{_num(seconds / size)} {unit}"


def _share(fraction: float) -> str:
    return "<0.1%" if 0 < fraction < 0.001 else f"{fraction:.1%}"


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: max(1, n - 3)] + "..."


def _wrap(text: str, width_in: float, fontsize: float) -> str:
    """Wrap each line of `text` to fit a width in inches (DejaVu Sans averages ~0.6 em per char)."""
    chars = max(20, int(width_in * 72 / (0.6 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else ("es" if noun.endswith(("ch", "sh", "s", "x")) else "s"))


def _model_name(plan: "Plan") -> str:
    return plan.model_class.rsplit(".", 1)[-1]


def describe(plan: "Plan") -> str:
    """One line naming model, cluster and size, e.g. "GPT on dgx-a100-80gb (2 nodes x 8 = 16 devices)"."""
    c = plan.cluster
    nodes = f"{c.num_nodes} node" + ("s" if c.num_nodes != 1 else "")
    return f"{_model_name(plan)} on {c.name} ({nodes} x {c.devices_per_node} = {c.num_devices} devices)"


def _config_line(plan: "Plan") -> str:
    p = plan.prediction
    m = p.num_micro_batches
    c = plan.config
    return (f"{c.short()}; global batch {plan.global_batch_size} = {c.data} data x {_count(m, 'micro-batch')} "
            f"x {c.micro_batch_size}")


def title_for(plan: "Plan", what: str, extra: str = "") -> str:
    """The two-line title every figure carries: what + model/cluster, then the config."""
    return f"{what}: {describe(plan)}\n{_config_line(plan)}" + (f"\n{extra}" if extra else "")


def _rc() -> dict:
    return {
        "svg.fonttype": "none",       # keep text as <text>: searchable, small, testable
        "svg.hashsalt": "meshplan",   # reproducible SVG ids
        "font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8,
        "xtick.labelsize": 8, "ytick.labelsize": 8, "figure.titlesize": 11,
        "axes.spines.top": False, "axes.spines.right": False,
    }


def _new_figure(width: float, height: float) -> "Figure":
    """A figure on its own Agg canvas (non-interactive; pyplot's global state is untouched)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    fig.get_layout_engine().set(h_pad=0.06, w_pad=0.06)
    return fig


def _suptitle(fig: "Figure", text: str) -> None:
    size = 11
    fig.suptitle(_wrap(text, fig.get_figwidth() - 0.3, size), fontsize=size)


def _text_size_pt(text: str, fontsize: float) -> tuple[float, float]:
    """Rough (width, height) of text in points, DejaVu Sans."""
    lines = text.split("\n")
    return max(len(s) for s in lines) * 0.62 * fontsize, len(lines) * 1.25 * fontsize


def _px_per_data(ax) -> tuple[float, float]:
    """Display pixels per data unit along x and y (after layout)."""
    (x0, y0), (x1, y1) = ax.transData.transform([(0, 0), (1, 1)])
    return abs(x1 - x0), abs(y1 - y0)


def _thin_ticks(n: int, max_labels: int) -> int:
    return max(1, math.ceil(n / max_labels))


def _luminance(color) -> float:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    return 0.299 * r + 0.587 * g + 0.114 * b


def _stage_colors(n: int) -> list:
    from matplotlib import colormaps

    if n <= 10:
        cmap = colormaps["tab10"]
        return [cmap(i) for i in range(n)]
    if n <= 20:
        cmap = colormaps["tab20"]
        return [cmap(i) for i in range(n)]
    cmap = colormaps["viridis"]
    return [cmap(i / (n - 1)) for i in range(n)]


def _right_labels(ax, positions: Sequence[float], labels: Sequence[str]):
    """Tick labels on the right of a horizontal-bar axes (laid out by constrained layout, never overlapping bars)."""
    ax2 = ax.twinx()
    ax2.set_ylim(ax.get_ylim())
    ax2.set_yticks(list(positions), list(labels))
    ax2.tick_params(axis="y", length=0)
    for side in ("top", "right", "left", "bottom"):
        ax2.spines[side].set_visible(False)
    return ax2


def _drop_colliding(texts: list, renderer) -> None:
    """Hide texts (in order of priority) that would overlap an earlier visible one."""
    kept = []
    for t in texts:
        box = t.get_window_extent(renderer)
        if any(box.overlaps(k) for k in kept):
            t.set_visible(False)
        else:
            kept.append(box)


def layout_problems(fig: "Figure") -> list[str]:
    """Texts that overlap each other or stick out of the figure, after drawing (empty = readable)."""
    from matplotlib.text import Text

    fig.canvas.draw()  # creates the ticks the layout needs
    drawn: list = []
    originals = {}
    for t in fig.findobj(Text):
        originals[t] = t.draw

        def recorder(renderer, _t=t, _draw=t.draw):
            drawn.append(_t)
            return _draw(renderer)

        t.draw = recorder
    try:
        fig.canvas.draw()
    finally:
        for t in originals:
            del t.draw
    renderer = fig.canvas.get_renderer()
    boxes = []
    for t in drawn:
        if not t.get_visible() or not t.get_text().strip():
            continue
        boxes.append((t.get_text(), t.get_window_extent(renderer)))
    problems = []
    w, h = fig.bbox.width, fig.bbox.height
    for text, b in boxes:
        if b.x0 < -1 or b.y0 < -1 or b.x1 > w + 1 or b.y1 > h + 1:
            problems.append(f"text {text!r} sticks out of the figure")
    boxes.sort(key=lambda tb: tb[1].x0)
    for k, (ta, a) in enumerate(boxes):
        for tb, b in boxes[k + 1:]:
            if b.x0 >= a.x1 - 0.5:
                break
            if min(a.y1, b.y1) - max(a.y0, b.y0) > 0.5 and min(a.x1, b.x1) - max(a.x0, b.x0) > 0.5:
                problems.append(f"texts {ta!r} and {tb!r} overlap")
    return problems


# ---------------------------------------------------------------------------
# a. Device mesh


def _cell_grid(n: int) -> tuple[int, int]:
    """(rows, cols) for n cells of one node: a divisor of n near sqrt(2n) columns, wider than tall."""
    if n <= 4:
        return 1, n
    target = math.sqrt(2 * n)
    cols = min((c for c in range(1, n + 1) if n % c == 0 and c * c >= n), key=lambda c: (abs(c - target), c))
    if cols > 2 * target + 1:  # a prime or awkward count: do not make one long row
        cols = math.ceil(target)
    return math.ceil(n / cols), cols


def _stage_legend_label(plan: "Plan", i: int) -> str:
    stages = [s for s in plan.stages if s.device_index == i]
    if not stages:
        return f"stage {i}"
    if len(stages) == 1:
        s = stages[0]
        span = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]}"
        return _short(f"stage {i}: {span} ({len(s.layers)} layer{'s' if len(s.layers) != 1 else ''})", 46)
    chunks = ", ".join(str(s.index) for s in stages)
    first = "; ".join(s.layers[0] for s in stages)
    return _short(f"pipe {i}: chunks {chunks} ({first})", 46)


def mesh_figure(plan: "Plan") -> "Figure":
    """One cell per device inside a box per node, coloured by pipeline stage (the pipe coordinate)."""
    from matplotlib.patches import Patch, Rectangle

    _check_plan(plan)
    cfg, cluster = plan.config, plan.cluster
    mesh = cfg.mesh
    world = cfg.num_devices
    dpn = cluster.devices_per_node
    replica = world > MAX_MESH_DEVICES
    if replica:  # one data-parallel replica: data coordinate 0
        ranks = [_rank_of(pi, 0, ti, mesh) for pi in range(cfg.pipeline) for ti in range(cfg.tensor)]
    else:
        ranks = list(range(world))
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(r // dpn, []).append(r)
    nodes = sorted(by_node)
    per_node = max(len(v) for v in by_node.values())
    rows, cols = _cell_grid(per_node)

    pad, label_h, gap = 0.2, 0.6, 0.35
    block_w, block_h = cols + 2 * pad, rows + pad + label_h
    # Node blocks in a grid whose overall shape is near 2:1 (wide).
    n_nodes = len(nodes)
    def shape_cost(c: int) -> float:
        r = math.ceil(n_nodes / c)
        aspect = (c * (block_w + gap)) / (r * (block_h + gap))
        return abs(math.log(aspect / 2.2)) + 0.5 * (r * c - n_nodes) / n_nodes

    ncol = min(range(1, n_nodes + 1), key=shape_cost)
    nrow = math.ceil(n_nodes / ncol)
    width_units = ncol * (block_w + gap) - gap
    height_units = nrow * (block_h + gap) - gap

    colors = _stage_colors(cfg.pipeline)
    use_colorbar = cfg.pipeline > 20
    inch_per_unit = min(0.75, 13.0 / width_units, 11.0 / height_units)
    legend_w = 1.0 if use_colorbar else 4.2
    fig_w = max(9.0, width_units * inch_per_unit + legend_w + 0.8)
    fig_h = max(4.2, height_units * inch_per_unit + 2.2)
    if not use_colorbar:  # room for the legend rows
        fig_h = max(fig_h, 0.2 * min(cfg.pipeline, 20) + 2.4)
    fig = _new_figure(fig_w, fig_h)
    ax = fig.add_subplot()

    cells = []  # (rank, x, y, colour)
    for k, node in enumerate(nodes):
        bx = (k % ncol) * (block_w + gap)
        by = (nrow - 1 - k // ncol) * (block_h + gap)  # first node at the top left
        ax.add_patch(Rectangle((bx, by), block_w, block_h, facecolor="#FAFAFA", edgecolor="#444444", lw=1.0))
        for j, r in enumerate(by_node[node]):
            cx = bx + pad + j % cols
            cy = by + pad + (rows - 1 - j // cols)
            pipe_i = rank_coords(r, mesh)[0]
            col = colors[pipe_i]
            ax.add_patch(Rectangle((cx + 0.04, cy + 0.04), 0.92, 0.92, facecolor=col, edgecolor="white", lw=0.5))
            cells.append((r, cx, cy, col))
        ax.text(bx + pad, by + block_h - label_h / 2, "", va="center", ha="left", gid=f"node-{node}")
    ax.set_xlim(-0.1, width_units + 0.1)
    ax.set_ylim(-0.1, height_units + 0.1)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)

    if use_colorbar:
        from matplotlib import colormaps
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        sm = ScalarMappable(norm=Normalize(0, cfg.pipeline - 1), cmap=colormaps["viridis"])
        fig.colorbar(sm, ax=ax, label="pipeline stage (pipe coordinate)", shrink=0.8)
    else:
        handles = [Patch(facecolor=colors[i], label=_stage_legend_label(plan, i)) for i in range(cfg.pipeline)]
        ax.legend(handles=handles, title="colour: pipeline stage", loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)

    extra = ""
    if replica:
        extra = (f"one data-parallel replica shown (pipe {cfg.pipeline} x tensor {cfg.tensor} = {len(ranks)} "
                 f"of {world} devices) x {cfg.data} data replicas" if cfg.data > 1 else
                 f"all {world} devices (one pipeline, no data parallelism)")
    elif cfg.schedule == "interleaved":
        extra = f"interleaved schedule: each device holds {cfg.virtual_stages} model chunks"
    _suptitle(fig, title_for(plan, "Device mesh", extra))

    # Labels sized to the cells as laid out.
    fig.canvas.draw()
    px, _ = _px_per_data(ax)
    cell_pt = 0.92 * px * 72 / fig.dpi
    interleaved = cfg.schedule == "interleaved"

    def label(r: int, full: bool) -> str:
        pi, di, ti = rank_coords(r, mesh)
        if not full:
            return f"r{r}"
        text = f"r{r}\n({pi},{di},{ti})"
        if interleaved:
            text += "\nc" + ",".join(str(c * cfg.pipeline + pi) for c in range(cfg.virtual_stages))
        return text

    labelled = "rank, (pipe, data, tensor)" + (", chunks" if interleaved else "")
    fontsize = 0.0
    for full in (True, False):
        sample = max((label(r, full) for r, *_ in cells), key=lambda s: max(map(len, s.split("\n"))))
        w, h = _text_size_pt(sample, 1.0)
        fontsize = min(9.0, 0.9 * cell_pt / w, 0.9 * cell_pt / h)
        if fontsize >= 4.5:
            if not full:
                labelled = "rank"
            for r, cx, cy, col in cells:
                ax.text(cx + 0.5, cy + 0.5, label(r, full), ha="center", va="center", fontsize=fontsize,
                        color="black" if _luminance(col) > 0.5 else "white", linespacing=1.1)
            break
    else:
        labelled, fontsize = "", 0.0
    node_font = max(5.0, min(9.0, fontsize + 1 if fontsize else 7.0))
    node_texts = [t for t in ax.texts if (t.get_gid() or "").startswith("node-")]
    px_pt = px * 72 / fig.dpi
    for t in node_texts:
        node = int(t.get_gid()[5:])
        text = f"node {node}"
        shown = len(by_node[node])
        if shown < dpn and _text_size_pt(f"{text} ({shown} of {dpn})", node_font)[0] <= (block_w - pad) * px_pt:
            text += f" ({shown} of {dpn})"
        t.set_text(text)
        t.set_fontsize(node_font)
    _drop_colliding(node_texts, fig.canvas.get_renderer())
    what = "boxes: nodes (ranks are node-major" + (", only the replica's devices drawn)" if replica else ")")
    ax.set_xlabel(f"{what}; cell label: {labelled}" if labelled else f"{what}; too many cells to label")
    return fig


# ---------------------------------------------------------------------------
# b. Memory per device


def memory_figure(plan: "Plan") -> "Figure":
    """Stacked memory per device for every pipeline stage against the device capacity."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    _check_plan(plan)
    cfg, pred = plan.config, plan.prediction
    p = cfg.pipeline
    # Chunk i runs on pipe position i, so stages[i] holds position i's footprint.
    mems = [pred.stages[i].memory for i in range(p)]
    comps = [f.name for f in dataclasses.fields(mems[0])]
    comps = [c for c in comps if any(getattr(m, c) > 0 for m in mems)] or comps[:1]
    peak = max(m.total for m in mems)
    cap = pred.memory_capacity
    show_cap = cap > 0 and (peak >= 0.05 * cap or not pred.fits)
    unit, size = _memory_unit(max(peak, cap) if show_cap else peak)

    fig = _new_figure(max(10.0, min(16.0, 5.5 + 0.35 * p)), 5.2)
    ax = fig.add_subplot()
    xs = list(range(p))
    bottom = [0.0] * p
    for c in comps:
        vals = [getattr(m, c) / size for m in mems]
        ax.bar(xs, vals, 0.7, bottom=bottom, color=MEMORY_COLORS.get(c, "#999999"), label=MEMORY_NAMES.get(c, c),
               edgecolor="white", linewidth=0.5)
        bottom = [b + v for b, v in zip(bottom, vals)]
    handles = [Patch(facecolor=MEMORY_COLORS.get(c, "#999999"), label=MEMORY_NAMES.get(c, c)) for c in comps]
    top = peak / size
    if show_cap:
        ax.axhline(cap / size, color="#B22222", linestyle="--", linewidth=1.2)
        handles.append(Line2D([], [], color="#B22222", linestyle="--",
                              label=f"device capacity {_num(cap / size)} {unit}"))
        top = max(top, cap / size)
    else:
        cu, cs = _memory_unit(cap)
        ax.set_title(f"device capacity {_num(cap / cs)} {cu} is off the scale: the peak uses "
                     f"{peak / cap:.2%} of it" if cap else "device capacity unknown", fontsize=9)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    interleaved = cfg.schedule == "interleaved"
    labels = []
    for i in range(p):
        lab = f"{i}"
        if interleaved:
            lab += "\n(" + ",".join(str(c * p + i) for c in range(cfg.virtual_stages)) + ")"
        labels.append(lab)
    step = _thin_ticks(p, 32 if not interleaved else 16)
    ax.set_xticks(xs[::step], labels[::step])
    ax.set_xlabel("pipeline stage (pipe coordinate" + (", chunks in parentheses" if interleaved else "")
                  + "); every device of a stage holds this footprint")
    ax.set_ylabel(f"memory per device ({unit})")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    status = "fits" if pred.fits else "DOES NOT FIT"
    pu, ps = _memory_unit(peak)
    _suptitle(fig, title_for(plan, "Memory per device",
                             f"peak {_num(peak / ps)} {pu} of {_num(cap / _memory_unit(cap)[1])} "
                             f"{_memory_unit(cap)[0]} ({status})"))
    if p <= 48:  # totals above the bars, dropped where they would collide
        fig.canvas.draw()
        texts = [ax.text(i, mems[i].total / size, _num(mems[i].total / size), ha="center", va="bottom",
                         fontsize=7.5 if p <= 16 else 6.5) for i in range(p)]
        order = sorted(range(p), key=lambda i: -mems[i].total)
        _drop_colliding([texts[i] for i in order], fig.canvas.get_renderer())
    return fig


# ---------------------------------------------------------------------------
# c. Time breakdown


def time_figure(plan: "Plan") -> "Figure":
    """One step's time split into components: a stacked bar and a bar per component with its share."""
    from matplotlib.patches import Patch

    _check_plan(plan)
    pred = plan.prediction
    t = pred.time
    comps = [(f.name, getattr(t, f.name)) for f in dataclasses.fields(t) if getattr(t, f.name) > 0]
    total = t.total or pred.step_time or 1.0
    unit, size = _time_unit(max(total, pred.step_time))
    fig = _new_figure(11.0, 2.6 + 0.32 * max(len(comps), 3))
    gs = fig.add_gridspec(2, 1, height_ratios=[1, max(len(comps), 3) * 0.55])
    top = fig.add_subplot(gs[0])
    left = 0.0
    segs = []
    for name, v in comps:
        top.barh(0, v / size, left=left, color=TIME_COLORS.get(name, "#999999"), edgecolor="white",
                 linewidth=0.8, height=0.8)
        segs.append((name, left, v))
        left += v / size
    top.set_xlim(0, total / size)
    top.set_ylim(-0.5, 0.5)
    top.set_yticks([0], ["one step"])
    top.set_xlabel(f"time within one step ({unit})")

    bottom = fig.add_subplot(gs[1])
    ys = list(range(len(comps)))[::-1]
    for y, (name, v) in zip(ys, comps):
        bottom.barh(y, v / size, color=TIME_COLORS.get(name, "#999999"), height=0.7)
    bottom.set_yticks(ys, [TIME_NAMES.get(n, n) for n, _ in comps])
    bottom.set_ylim(-0.6, len(comps) - 0.4)
    bottom.set_xlim(0, max((v for _, v in comps), default=1.0) / size * 1.02)
    bottom.set_xlabel(f"time per step ({unit})")
    _right_labels(bottom, ys, [f"{_fmt_time(v)}  {_share(v / total)}" for _, v in comps])
    handles = [Patch(facecolor=TIME_COLORS.get(n, "#999999"), label=TIME_NAMES.get(n, n)) for n, _ in comps]
    fig.legend(handles=handles, loc="outside lower center",
               ncol=len(handles) if len(handles) <= 6 else math.ceil(len(handles) / 2), frameon=False)
    sps = f", {pred.samples_per_s:,.1f} samples/s" + (f", {pred.tokens_per_s:,.0f} tokens/s"
                                                        if pred.tokens_per_s else "")
    _suptitle(fig, title_for(plan, "Time per step",
                             f"step {_num(pred.step_time / size)} {unit}{sps}, MFU {pred.mfu:.1%}"))
    # Percentages inside the stacked bar where they fit.
    fig.canvas.draw()
    px, _ = _px_per_data(top)
    for name, x0, v in segs:
        text = f"{v / total:.0%}"
        w_pt = v / size * px * 72 / fig.dpi
        if _text_size_pt(text, 8)[0] <= 0.85 * w_pt:
            col = TIME_COLORS.get(name, "#999999")
            top.text(x0 + v / size / 2, 0, text, ha="center", va="center", fontsize=8,
                     color="black" if _luminance(col) > 0.5 else "white")
    return fig


# ---------------------------------------------------------------------------
# d. Alternatives


def alternatives_figure(plan: "Plan", top: int = 12) -> "Figure":
    """The chosen plan and the runners-up: step time, fit, and why each lost."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    _check_plan(plan)
    pred = plan.prediction
    alts = list(plan.alternatives[:top])
    rows = [("chosen: " + plan.config.short(), pred.step_time, "chosen", "")]
    for k, a in enumerate(alts, 1):
        rel = a.step_time / pred.step_time - 1 if pred.step_time else 0.0
        rows.append((f"#{k} {a.config.short()}", a.step_time, "fits" if a.fits else "nofit",
                     f"{rel:+.1%}  lost on {a.reason}"))
    unit, size = _time_unit(max(r[1] for r in rows))
    colors = {"chosen": "#4C72B0", "fits": "#55A868", "nofit": "#C44E52"}
    fig = _new_figure(13.0, 2.6 + 0.36 * max(len(rows), 3))
    ax = fig.add_subplot()
    ys = list(range(len(rows)))[::-1]
    for y, (_, t, status, _) in zip(ys, rows):
        ax.barh(y, t / size, color=colors[status], height=0.65, hatch="//" if status == "nofit" else None,
                edgecolor="white" if status != "nofit" else "#7A1F22", linewidth=0.5)
    ax.axvline(pred.step_time / size, color="#4C72B0", linestyle=":", linewidth=1.2)
    ax.set_yticks(ys, [_short(r[0], 60) for r in rows])
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(0, max(r[1] for r in rows) / size * 1.03)
    ax.set_xlabel(f"predicted step time ({unit})")
    _right_labels(ax, ys, [_short(f"{_num(t / size)} {unit}  {why}".rstrip(), 60) for _, t, _, why in rows])
    present = {r[2] for r in rows}
    handles = [Patch(facecolor=colors["chosen"], label="chosen plan")]
    if "fits" in present:
        handles.append(Patch(facecolor=colors["fits"], label="alternative that fits"))
    if "nofit" in present:
        handles.append(Patch(facecolor=colors["nofit"], hatch="//", edgecolor="#7A1F22",
                             label="alternative that does not fit (memory or a limit)"))
    handles.append(Line2D([], [], color="#4C72B0", linestyle=":", label="chosen step time"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    extra = "right: step time, change vs the chosen plan, and the component that made it lose"
    if not alts:
        extra = ("no alternatives recorded: the plan was made for a fixed configuration "
                 "(planner.optimize records the runners-up)")
    elif len(plan.alternatives) > top:
        extra = f"best {top} of {len(plan.alternatives)} alternatives; " + extra
    _suptitle(fig, title_for(plan, "Alternatives", extra))
    return fig


# ---------------------------------------------------------------------------
# e. Pipeline schedule (Gantt)


def _lanes(records: Sequence[ScheduleRecord]) -> tuple[dict[int, int], dict[int, int]]:
    """Lane per record index so overlapping records of one rank stack (interval partitioning);
    returns (lane by record index, lanes per rank)."""
    lane_of: dict[int, int] = {}
    ends: dict[int, list[float]] = {}
    for k in sorted(range(len(records)), key=lambda k: (records[k].start, records[k].end)):
        r = records[k]
        lanes = ends.setdefault(r.rank, [])
        for li, e in enumerate(lanes):
            if e <= r.start + 1e-15:
                lanes[li] = r.end
                lane_of[k] = li
                break
        else:
            lanes.append(r.end)
            lane_of[k] = len(lanes) - 1
    return lane_of, {rank: len(v) for rank, v in ends.items()}


_OP_RE = re.compile(r"^(\w+)\s+s(\d+)\s+m(\d+)$")


def _box_labels(label: str) -> list[str]:
    m = _OP_RE.match(label)
    if m:
        return [label, f"{m.group(1)}{m.group(3)}"]
    return [label, label.split()[0][:5]] if label.split() else [label]


def schedule_figure(plan: "Plan", timeline: Iterable[Any] | None = None, measured: Iterable[Any] | None = None,
                    *, max_micro_batches: int = DEFAULT_MAX_MICRO_BATCHES) -> "Figure":
    """Gantt chart per rank: the predicted schedule, and the measured one beside it when given.

    Without `timeline`, the prediction is simulated from the plan
    (:func:`predicted_schedule`), capped at `max_micro_batches` when it is drawn
    alone; next to a measured timeline it is drawn in full so both show one step.
    """
    from matplotlib.patches import Patch

    _check_plan(plan)
    cfg, pred = plan.config, plan.prediction
    meas = as_records(measured, "measured timeline") if measured is not None else None
    note = ""
    if timeline is None:
        m = pred.num_micro_batches
        cap = None if meas is not None else max_micro_batches
        ranks = None
        if meas:
            ranks = sorted({r.rank for r in meas if r.rank < cfg.num_devices}) or None
        predicted = predicted_schedule(plan, max_micro_batches=cap, ranks=ranks)
        shown = min(m, cap) if cap else m
        sched = cfg.schedule + (f" x{cfg.virtual_stages}" if cfg.schedule == "interleaved" else "")
        note = (f"{sched} schedule simulated from the plan's per-stage times (p2p free), "
                + (f"first {shown} of {m} micro-batches" if shown < m else _count(m, "micro-batch")))
        if ranks is None and cfg.data * cfg.tensor > 1:
            note += f"; one pipeline (data 0, tensor 0) of {cfg.data * cfg.tensor}"
        pred_title = "predicted"
    else:
        predicted = as_records(timeline, "timeline")
        pred_title = "predicted" if meas is not None else "timeline"
    panels = [(pred_title, predicted)] + ([("measured", meas)] if meas is not None else [])
    for name, recs in panels:
        if not recs:
            raise ValueError(f"the {name} timeline has no records; pass at least one (rank, label, kind, start, end)")

    def origin(recs):
        return min(r.start for r in recs)

    spans = [max(r.end for r in recs) - origin(recs) for _, recs in panels]
    unit, size = _time_unit(max(spans))
    share_x = max(spans) <= 4 * max(min(spans), 1e-300)
    all_ranks = sorted({r.rank for _, recs in panels for r in recs})
    row_of = {rank: k for k, rank in enumerate(all_ranks)}
    n_rows = len(all_ranks)

    fig = _new_figure(14.0 if len(panels) == 1 else 16.0, min(30.0, max(4.0, 2.6 + 0.32 * n_rows)))
    axes = fig.subplots(1, len(panels), sharey=True, sharex=share_x, squeeze=False)[0]
    kinds_used: list[str] = []
    boxes = []  # (ax, x0, width, yc, height, label, colour) for labels after layout
    for ax, (name, recs) in zip(axes, panels):
        t0 = origin(recs)
        lane_of, lanes = _lanes(recs)
        groups: dict[tuple[int, int, str], list[tuple[float, float]]] = {}
        for k, r in enumerate(recs):
            nl = lanes[r.rank]
            h = 0.84 / nl
            y0 = row_of[r.rank] - 0.42 + lane_of[k] * h
            groups.setdefault((row_of[r.rank], lane_of[k], r.kind), []).append(
                ((r.start - t0) / size, r.duration / size))
            if r.kind not in kinds_used:
                kinds_used.append(r.kind)
            boxes.append((ax, (r.start - t0) / size, r.duration / size, y0 + h / 2, h, r.label,
                          KIND_COLORS[r.kind]))
        for (row, lane, kind), xr in groups.items():
            rank = all_ranks[row]
            nl = lanes[rank]
            h = 0.84 / nl
            ax.broken_barh(xr, (row - 0.42 + lane * h, h), facecolors=KIND_COLORS[kind],
                           edgecolor="white", linewidth=0.4)
        span = max(r.end for r in recs) - t0
        ax.set_facecolor(IDLE_COLOR)
        ax.set_xlim(0, span / size * 1.01 if span > 0 else 1.0)
        ax.set_title(f"{name}: {len(recs)} records, makespan {_num(span / size)} {unit}", fontsize=10)
        ax.set_xlabel(f"time since the first record ({unit})")
        ax.grid(axis="x", color="white", linewidth=0.8)
        ax.set_axisbelow(True)
    if share_x:
        right = max(spans) / size * 1.01
        for ax in axes:
            ax.set_xlim(0, right if right > 0 else 1.0)
    axes[0].set_ylim(n_rows - 0.5, -0.5)  # rank 0 on top
    mesh = cfg.mesh

    def rank_label(r: int) -> str:
        if r < cfg.num_devices:
            return f"{r} ({','.join(map(str, rank_coords(r, mesh)))})"
        return str(r)

    step = _thin_ticks(n_rows, 40)
    axes[0].set_yticks(list(range(0, n_rows, step)), [rank_label(r) for r in all_ranks[::step]])
    axes[0].set_ylabel("rank (pipe, data, tensor)")
    kinds_used.sort(key=KINDS.index)
    handles = [Patch(facecolor=KIND_COLORS[k], label=k) for k in kinds_used]
    handles.append(Patch(facecolor=IDLE_COLOR, edgecolor="#999999", label="idle"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    what = "Pipeline schedule" + (" (predicted vs measured)" if meas is not None else "")
    _suptitle(fig, title_for(plan, what, note))

    # Labels inside boxes that are wide and tall enough, in the first form that fits.
    if len(boxes) <= 3000:
        fig.canvas.draw()
        for ax, x0, w, yc, h, label, col in boxes:
            px, py = _px_per_data(ax)
            w_pt, h_pt = w * px * 72 / fig.dpi, h * py * 72 / fig.dpi
            fs = min(7.0, 0.7 * h_pt)
            if fs < 4.5:
                continue
            for text in _box_labels(label):
                if _text_size_pt(text, fs)[0] <= 0.9 * w_pt - 2:
                    ax.text(x0 + w / 2, yc, text, ha="center", va="center", fontsize=fs, clip_on=True,
                            color="black" if _luminance(col) > 0.5 else "white")
                    break
    return fig


# ---------------------------------------------------------------------------
# Entry points


def figures(plan: "Plan", *, timeline: Iterable[Any] | None = None, measured: Iterable[Any] | None = None,
            max_micro_batches: int = DEFAULT_MAX_MICRO_BATCHES) -> dict[str, "Figure"]:
    """All five figures by name (see FIGURES), in order. Call inside `style()` to keep the house style."""
    _check_plan(plan)
    # Validate the timelines before drawing anything.
    if timeline is not None:
        timeline = as_records(timeline, "timeline")
    if measured is not None:
        measured = as_records(measured, "measured timeline")
    return {
        "mesh": mesh_figure(plan),
        "memory": memory_figure(plan),
        "time": time_figure(plan),
        "alternatives": alternatives_figure(plan),
        "schedule": schedule_figure(plan, timeline, measured, max_micro_batches=max_micro_batches),
    }


def style():
    """The rc settings every figure is drawn and saved under (a context manager)."""
    import matplotlib

    return matplotlib.rc_context(_rc())


def save_figure(fig: "Figure", path: Path, fmt: str) -> None:
    """Save as PNG or SVG; OSError becomes ValueError naming the file."""
    metadata = {"Date": None} if fmt == "svg" else {"Software": None}
    try:
        fig.savefig(path, format=fmt, dpi=DPI, metadata=metadata)
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror or e}; pass a path in a writable directory") from None


def output_stem(path: str | os.PathLike) -> tuple[Path, str]:
    """(directory, file-name prefix) for `path`: an existing directory or one ending in a
    separator -> (it, ""); otherwise a file stem -> (its parent, "<name>_"), with a
    picture suffix (.png, .svg, .html) dropped. Creates the directory; ValueError if it cannot."""
    raw = os.fspath(path)
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"path must name a directory or a file stem, got {path!r}")
    p = Path(raw).expanduser()
    if p.is_dir() or raw.endswith(("/", os.sep)):
        directory, prefix = p, ""
    else:
        name = p.name[: -len(p.suffix)] if p.suffix.lower() in _IMAGE_SUFFIXES else p.name
        directory, prefix = p.parent, name + "_"
    make_directory(directory)
    return directory, prefix


def make_directory(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create directory {directory} for the pictures: {e.strerror or e}; "
                         f"pass a path whose parent is a writable directory") from None
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory; pass a directory or a file stem inside one")


def visualize(plan: "Plan", path: str | os.PathLike, *, timeline: Iterable[Any] | None = None,
              measured: Iterable[Any] | None = None, formats: Sequence[str] = FORMATS,
              max_micro_batches: int = DEFAULT_MAX_MICRO_BATCHES) -> list[Path]:
    """Write the plan's pictures (see FIGURES) as PNG and SVG; return their paths.

    Args:
        plan: a planner.Plan.
        path: a directory (existing, or ending in "/": files are mesh.png, mesh.svg, ...)
            or a file stem ("out/gpt": out/gpt_mesh.png, ...). Missing directories are created.
        timeline: schedule records (ScheduleRecord, dicts, 5-tuples) of the predicted
            schedule; default: simulated from the plan (predicted_schedule).
        measured: records measured by the runtime; drawn beside the prediction.
        formats: any of "png", "svg".
        max_micro_batches: micro-batches drawn when the predicted schedule is drawn alone.

    Raises:
        ValueError: the plan, a record (end before start, unknown kind) or the path is bad.
    """
    _check_plan(plan)
    fmts = tuple(formats)
    bad = [f for f in fmts if f not in FORMATS]
    if bad or not fmts:
        raise ValueError(f"formats {list(fmts)!r}: choose from {', '.join(FORMATS)}")
    directory, prefix = output_stem(path)
    written: list[Path] = []
    with style():
        figs = figures(plan, timeline=timeline, measured=measured, max_micro_batches=max_micro_batches)
        for name, fig in figs.items():
            for fmt in fmts:
                out = directory / f"{prefix}{name}.{fmt}"
                save_figure(fig, out, fmt)
                written.append(out)
    return written
