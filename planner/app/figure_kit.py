"""Shared pieces of the plan pictures: colours, units, text fitting, figure set-up and
layout checks (used by planner.app.visualize and planner.app.report).

matplotlib is imported inside the functions, never at import time.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from planner.plan import Plan

if TYPE_CHECKING:  # only for annotations; matplotlib is imported when a figure is drawn
    from matplotlib.figure import Figure


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
    "activations": "#8172B3", "comm_buffers": "#C44E52", "temporary": "#8C8C8C", "fragmentation": "#CCB974",
}
MEMORY_NAMES = {
    "parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state",
    "activations": "activations", "comm_buffers": "comm buffers", "temporary": "temporary",
    "fragmentation": "allocator fragmentation",
}
IDLE_COLOR = "#F2F2F2"

_IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".html", ".htm")

# ---------------------------------------------------------------------------
# Small helpers: units, text, figures


def _check_plan(plan: Any) -> None:
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


