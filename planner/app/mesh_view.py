"""The device-mesh picture of a plan (planner.app.visualize's first figure): one cell per device inside a
box per node, coloured by pipeline stage, each cell labelled as fully as its size allows."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from planner.app.figure_kit import (MAX_MESH_DEVICES, _check_plan, _drop_colliding, _luminance, _new_figure,
                                    _px_per_data, _short, _stage_colors, _suptitle, _text_size_pt, title_for)
from cost_models.mesh_axes import innermost, rank_at, rank_coords

if TYPE_CHECKING:  # only for annotations; nothing is imported at run time
    from matplotlib.figure import Figure

    from planner.plan import Plan


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
    _check_plan(plan)
    cfg = plan.config
    ranks, by_node, replica = _mesh_ranks(plan)
    box = _NodeBoxes.of(by_node)
    colors = _stage_colors(cfg.pipeline)
    use_colorbar = cfg.pipeline > 20
    inch_per_unit = min(0.75, 13.0 / box.width, 11.0 / box.height)
    fig_w = max(9.0, box.width * inch_per_unit + (1.0 if use_colorbar else 4.2) + 0.8)
    fig_h = max(4.2, box.height * inch_per_unit + 2.2)
    if not use_colorbar:  # room for the legend rows
        fig_h = max(fig_h, 0.2 * min(cfg.pipeline, 20) + 2.4)
    fig = _new_figure(fig_w, fig_h)
    ax = fig.add_subplot()
    cells = _draw_nodes(ax, box, by_node, cfg.mesh, colors)
    _stage_key(fig, ax, plan, colors, use_colorbar)
    world = cfg.num_devices
    extra = ""
    if replica:
        inner, size = innermost(cfg.mesh)
        extra = (f"one data-parallel replica shown (pipe {cfg.pipeline} x {inner} {size} = {len(ranks)} "
                 f"of {world} devices) x {cfg.data} data replicas" if cfg.data > 1 else
                 f"all {world} devices (one pipeline, no data parallelism)")
    elif cfg.schedule == "interleaved":
        extra = f"interleaved schedule: each device holds {cfg.virtual_stages} model chunks"
    _suptitle(fig, title_for(plan, "Device mesh", extra))
    fig.canvas.draw()   # labels are sized to the cells as laid out
    pt_per_unit = _px_per_data(ax)[0] * 72 / fig.dpi   # points per data unit (one cell is 1 x 1)
    labelled, fontsize = _label_cells(ax, cells, cfg, pt_per_unit)
    _label_nodes(fig, ax, box, by_node, plan.cluster.devices_per_node, fontsize, pt_per_unit)
    what = "boxes: nodes (ranks are node-major" + (", only the replica's devices drawn)" if replica else ")")
    ax.set_xlabel(f"{what}; cell label: {labelled}" if labelled else f"{what}; too many cells to label")
    return fig


def _mesh_ranks(plan: "Plan") -> tuple[list[int], dict[int, list[int]], bool]:
    """(the ranks drawn, node -> its ranks drawn, whether only one data-parallel replica is drawn: above
    MAX_MESH_DEVICES devices, the ranks of data coordinate 0)."""
    cfg = plan.config
    world, mesh = cfg.num_devices, cfg.mesh
    replica = world > MAX_MESH_DEVICES
    if replica:
        ranks = [rank_at(pi, 0, ti, mesh) for pi in range(cfg.pipeline) for ti in range(innermost(mesh)[1])]
    else:
        ranks = list(range(world))
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(r // plan.cluster.devices_per_node, []).append(r)
    return ranks, by_node, replica


@dataclasses.dataclass(frozen=True)
class _NodeBoxes:
    """Where the node boxes go (data units: one device cell is 1 x 1): `ncol` x `nrow` boxes of
    `rows` x `cols` cells, laid out near 2:1 (wide)."""

    nodes: list[int]
    rows: int
    cols: int
    ncol: int
    nrow: int
    pad: float = 0.2
    label_h: float = 0.6
    gap: float = 0.35

    @classmethod
    def of(cls, by_node: dict[int, list[int]]) -> "_NodeBoxes":
        nodes = sorted(by_node)
        rows, cols = _cell_grid(max(len(v) for v in by_node.values()))
        probe = cls(nodes, rows, cols, 1, 1)
        n = len(nodes)

        def shape_cost(c: int) -> float:
            r = math.ceil(n / c)
            aspect = (c * (probe.block_w + probe.gap)) / (r * (probe.block_h + probe.gap))
            return abs(math.log(aspect / 2.2)) + 0.5 * (r * c - n) / n

        ncol = min(range(1, n + 1), key=shape_cost)
        return cls(nodes, rows, cols, ncol, math.ceil(n / ncol))

    @property
    def block_w(self) -> float:
        return self.cols + 2 * self.pad

    @property
    def block_h(self) -> float:
        return self.rows + self.pad + self.label_h

    @property
    def width(self) -> float:
        return self.ncol * (self.block_w + self.gap) - self.gap

    @property
    def height(self) -> float:
        return self.nrow * (self.block_h + self.gap) - self.gap

    def corner(self, k: int) -> tuple[float, float]:
        """The lower left corner of the k-th node's box (the first node at the top left)."""
        return (k % self.ncol) * (self.block_w + self.gap), (self.nrow - 1 - k // self.ncol) * (self.block_h + self.gap)


def _draw_nodes(ax, box: _NodeBoxes, by_node: dict[int, list[int]], mesh: dict[str, int],
                colors: list) -> list[tuple[int, float, float, Any]]:
    """The node boxes and device cells; returns the cells as (rank, x, y, colour). Each box gets an empty
    label (gid node-N) that _label_nodes fills once sizes are known."""
    from matplotlib.patches import Rectangle

    cells = []
    for k, node in enumerate(box.nodes):
        bx, by = box.corner(k)
        ax.add_patch(Rectangle((bx, by), box.block_w, box.block_h, facecolor="#FAFAFA", edgecolor="#444444", lw=1.0))
        for j, r in enumerate(by_node[node]):
            cx = bx + box.pad + j % box.cols
            cy = by + box.pad + (box.rows - 1 - j // box.cols)
            col = colors[rank_coords(r, mesh)[0]]
            ax.add_patch(Rectangle((cx + 0.04, cy + 0.04), 0.92, 0.92, facecolor=col, edgecolor="white", lw=0.5))
            cells.append((r, cx, cy, col))
        ax.text(bx + box.pad, by + box.block_h - box.label_h / 2, "", va="center", ha="left", gid=f"node-{node}")
    ax.set_xlim(-0.1, box.width + 0.1)
    ax.set_ylim(-0.1, box.height + 0.1)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    return cells


def _stage_key(fig, ax, plan: "Plan", colors: list, use_colorbar: bool) -> None:
    """What the colours mean: a colour bar above 20 stages, else a legend naming each stage."""
    from matplotlib.patches import Patch

    pipeline = plan.config.pipeline
    if use_colorbar:
        from matplotlib import colormaps
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        sm = ScalarMappable(norm=Normalize(0, pipeline - 1), cmap=colormaps["viridis"])
        fig.colorbar(sm, ax=ax, label="pipeline stage (pipe coordinate)", shrink=0.8)
    else:
        handles = [Patch(facecolor=colors[i], label=_stage_legend_label(plan, i)) for i in range(pipeline)]
        ax.legend(handles=handles, title="colour: pipeline stage", loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


def _label_cells(ax, cells: list, cfg, pt_per_unit: float) -> tuple[str, float]:
    """Each cell's label, as full as fits (rank and coordinates, else the rank, else none); returns (what
    the labels say, their font size in points; "" and 0 where none fits)."""
    mesh = cfg.mesh
    cell_pt = 0.92 * pt_per_unit
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
    for full in (True, False):
        sample = max((label(r, full) for r, *_ in cells), key=lambda s: max(map(len, s.split("\n"))))
        w, h = _text_size_pt(sample, 1.0)
        fontsize = min(9.0, 0.9 * cell_pt / w, 0.9 * cell_pt / h)
        if fontsize >= 4.5:
            for r, cx, cy, col in cells:
                ax.text(cx + 0.5, cy + 0.5, label(r, full), ha="center", va="center", fontsize=fontsize,
                        color="black" if _luminance(col) > 0.5 else "white", linespacing=1.1)
            return (labelled if full else "rank"), fontsize
    return "", 0.0


def _label_nodes(fig, ax, box: _NodeBoxes, by_node: dict[int, list[int]], dpn: int, fontsize: float,
                 pt_per_unit: float) -> None:
    """Name each node box ("node 3", with "(2 of 8)" where only some of its devices are drawn and it fits);
    labels that would collide are dropped."""
    node_font = max(5.0, min(9.0, fontsize + 1 if fontsize else 7.0))
    node_texts = [t for t in ax.texts if (t.get_gid() or "").startswith("node-")]
    for t in node_texts:
        node = int(t.get_gid()[5:])
        text = f"node {node}"
        shown = len(by_node[node])
        if shown < dpn and _text_size_pt(f"{text} ({shown} of {dpn})", node_font)[0] <= (box.block_w - box.pad) * pt_per_unit:
            text += f" ({shown} of {dpn})"
        t.set_text(text)
        t.set_fontsize(node_font)
    _drop_colliding(node_texts, fig.canvas.get_renderer())


__all__ = ["mesh_figure"]
