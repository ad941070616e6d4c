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
import math
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only for annotations; nothing is imported at run time
    from matplotlib.figure import Figure

    from planner.plan import Plan

from planner.app.figure_kit import (DEFAULT_MAX_MICRO_BATCHES, DPI, FIGURES, FORMATS, IDLE_COLOR, KINDS,
                                KIND_COLORS, MEMORY_COLORS, MEMORY_NAMES, TIME_COLORS,
                                TIME_NAMES, describe, layout_problems, title_for, _IMAGE_SUFFIXES,
                                _check_plan, _count, _drop_colliding, _fmt_time, _luminance, _memory_unit,
                                _new_figure, _num, _px_per_data, _rc, _right_labels, _share, _short,
                                _suptitle, _text_size_pt, _thin_ticks, _time_unit)
from cost_models.mesh_axes import innermost
from planner.app.mesh_view import mesh_figure
from planner.app.schedule_view import (ScheduleRecord, as_records, load_timeline, predicted_schedule, rank_coords,
                                   save_timeline, schedule_orders, simulate_schedule)

# Re-exported: the picture API in one place (planner.app.report and tests import from here).
__all__ = ['DEFAULT_MAX_MICRO_BATCHES', 'DPI', 'FIGURES', 'KINDS', 'ScheduleRecord', 'as_records', 'describe', 'layout_problems', 'load_timeline', 'predicted_schedule', 'rank_coords', 'save_timeline', 'schedule_orders', 'simulate_schedule', 'visualize', 'figures', 'style', 'save_figure', 'schedule_figure',
           'mesh_figure', 'memory_figure', 'time_figure', 'alternatives_figure', 'output_stem', 'make_directory']

# ---------------------------------------------------------------------------
# a. Device mesh: planner/app/mesh_view.py


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
    cfg = plan.config
    meas = as_records(measured, "measured timeline") if measured is not None else None
    panels, note = _schedule_panels(plan, timeline, meas, max_micro_batches)
    spans = [max(r.end for r in recs) - min(r.start for r in recs) for _, recs in panels]
    unit, size = _time_unit(max(spans))
    share_x = max(spans) <= 4 * max(min(spans), 1e-300)
    all_ranks = sorted({r.rank for _, recs in panels for r in recs})
    n_rows = len(all_ranks)

    fig = _new_figure(14.0 if len(panels) == 1 else 16.0, min(30.0, max(4.0, 2.6 + 0.32 * n_rows)))
    axes = fig.subplots(1, len(panels), sharey=True, sharex=share_x, squeeze=False)[0]
    kinds_used: list[str] = []
    boxes: list[tuple] = []  # (ax, x0, width, yc, height, label, colour) for labels after layout
    for ax, (name, recs) in zip(axes, panels):
        _schedule_panel(ax, name, recs, all_ranks, unit, size, kinds_used, boxes)
    if share_x:
        right = max(spans) / size * 1.01
        for ax in axes:
            ax.set_xlim(0, right if right > 0 else 1.0)
    axes[0].set_ylim(n_rows - 0.5, -0.5)  # rank 0 on top
    mesh = cfg.mesh

    def rank_label(r: int) -> str:
        return f"{r} ({','.join(map(str, rank_coords(r, mesh)))})" if r < cfg.num_devices else str(r)

    step = _thin_ticks(n_rows, 40)
    axes[0].set_yticks(list(range(0, n_rows, step)), [rank_label(r) for r in all_ranks[::step]])
    axes[0].set_ylabel("rank (pipe, data, tensor)")
    kinds_used.sort(key=KINDS.index)
    handles = [Patch(facecolor=KIND_COLORS[k], label=k) for k in kinds_used]
    handles.append(Patch(facecolor=IDLE_COLOR, edgecolor="#999999", label="idle"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    what = "Pipeline schedule" + (" (predicted vs measured)" if meas is not None else "")
    _suptitle(fig, title_for(plan, what, note))
    if len(boxes) <= 3000:
        _label_boxes(fig, boxes)
    return fig


def _schedule_panels(plan: "Plan", timeline: Iterable[Any] | None, meas: list | None,
                     max_micro_batches: int) -> tuple[list[tuple[str, list]], str]:
    """([(title, records)], note): the predicted schedule (`timeline`, else simulated) and `meas`."""
    cfg, pred = plan.config, plan.prediction
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
        if ranks is None and (lanes := cfg.data * innermost(cfg.mesh)[1]) > 1:   # the pipelines: data x tensor
            note += f"; one pipeline (data 0, tensor 0) of {lanes}"
        pred_title = "predicted"
    else:
        predicted = as_records(timeline, "timeline")
        pred_title = "predicted" if meas is not None else "timeline"
    panels = [(pred_title, predicted)] + ([("measured", meas)] if meas is not None else [])
    for name, recs in panels:
        if not recs:
            raise ValueError(f"the {name} timeline has no records; pass at least one (rank, label, kind, start, end)")
    return panels, note


def _schedule_panel(ax, name: str, recs: list, all_ranks: list[int], unit: str, size: float,
                    kinds_used: list[str], boxes: list[tuple]) -> None:
    """One panel's bars (a row per rank, lanes where records overlap); adds to `kinds_used`, `boxes`."""
    row_of = {rank: k for k, rank in enumerate(all_ranks)}
    t0 = min(r.start for r in recs)
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


def _label_boxes(fig, boxes: list[tuple]) -> None:
    """Labels inside the bars that are wide and tall enough, in the first form that fits."""
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

