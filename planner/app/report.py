"""`write_report`: one self-contained HTML page that explains a plan.

The page holds the plan summary, `planner.explain`, and the five figures of
`planner.app.visualize` inline as SVG (text stays searchable; ids are prefixed per
figure so they never clash). A figure whose SVG would be very large (a long
measured timeline) is embedded as a base64 PNG instead. No server, no external
JavaScript or CSS: the file can be mailed or attached to an issue as is.
"""

from __future__ import annotations

import base64
import html
import io
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from planner.app.visualize import (DEFAULT_MAX_MICRO_BATCHES, DPI, _check_plan, describe, figures, make_directory,
                                   style)
from planner.search import explain
from planner.plan import Plan

MAX_INLINE_SVG_BYTES = 2_000_000   # larger SVGs are embedded as PNG

CAPTIONS = {
    "mesh": "Device mesh: one cell per device (rank), boxed by node, coloured by pipeline stage; "
            "labels give the rank and its (pipe, data, tensor) coordinates.",
    "memory": "Memory per device for each pipeline stage, split into its components, against the device capacity.",
    "time": "Where one training step's time goes, by component, with each component's share.",
    "alternatives": "The configurations the search priced next: their step time against the chosen plan, "
                    "whether they fit, and why each lost.",
    "schedule": "Pipeline schedule per rank (Gantt chart); grey is idle time (the bubble).",
}
TITLES = {"mesh": "Device mesh", "memory": "Memory per device", "time": "Time per step",
          "alternatives": "Alternatives", "schedule": "Pipeline schedule"}

_CSS = """
body { font-family: -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1200px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; font-size: 0.85em; line-height: 1.35; }
figure { margin: 1em 0; } figcaption { color: #555; font-size: 0.9em; margin-top: 0.3em; }
figure svg, figure img { max-width: 100%; height: auto; display: block; }
nav a { margin-right: 1em; }
"""

_ID_RE = re.compile(r'\bid="([^"]+)"')


def _inline_svg(svg: str, prefix: str) -> str:
    """An SVG document as an inline <svg> element with its ids prefixed (unique within the page)."""
    start = svg.find("<svg")
    body = svg[start:] if start >= 0 else svg
    ids = set(_ID_RE.findall(body))
    if ids:
        body = _ID_RE.sub(lambda m: f'id="{prefix}{m.group(1)}"', body)
        refs = re.compile(r'(url\(#|href="#)(' + "|".join(re.escape(i) for i in sorted(ids, key=len, reverse=True))
                          + r')(?=[)"])')
        body = refs.sub(lambda m: f"{m.group(1)}{prefix}{m.group(2)}", body)
    return body


def _figure_html(name: str, fig, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    if len(svg) <= MAX_INLINE_SVG_BYTES:
        content = _inline_svg(svg.decode("utf-8"), f"{name}-")
    else:
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=DPI, metadata={"Software": None})
        data = base64.b64encode(png.getvalue()).decode("ascii")
        content = f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
    return (f'<h2 id="{name}">{html.escape(TITLES.get(name, name))}</h2>\n<figure>\n{content}\n'
            f"<figcaption>{html.escape(CAPTIONS.get(name, ''))}</figcaption>\n</figure>")


def report_path(path: str | os.PathLike) -> Path:
    """Where the report goes: "x.html" (or .htm) as is; a directory (existing, or ending in "/")
    gets report.html. Creates the directory; ValueError for any other name or an uncreatable directory."""
    raw = os.fspath(path)
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"path must name an HTML file or a directory, got {path!r}")
    p = Path(raw).expanduser()
    if p.is_dir() or raw.endswith(("/", os.sep)):
        out = p / "report.html"
    elif p.suffix.lower() in (".html", ".htm"):
        out = p
    else:
        raise ValueError(f"report path {raw!r} must end in .html (or name a directory, which gets report.html)")
    make_directory(out.parent)
    return out


def render_report(plan: "Plan", *, timeline: Iterable[Any] | None = None,
                  measured: Iterable[Any] | None = None, max_micro_batches: int | None = None) -> str:
    """The report as an HTML string (see write_report)."""
    with style():
        figs = figures(plan, timeline=timeline, measured=measured,
                       max_micro_batches=max_micro_batches or DEFAULT_MAX_MICRO_BATCHES)
        parts = [_figure_html(name, fig, f"{TITLES.get(name, name)}: {describe(plan)}")
                 for name, fig in figs.items()]
    title = f"meshplan plan: {describe(plan)}"
    nav = " ".join(f'<a href="#{n}">{html.escape(TITLES.get(n, n))}</a>' for n in figs)
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>Configuration <code>{html.escape(plan.config.short())}</code>, global batch "
        f"{plan.global_batch_size}, graph fingerprint <code>{html.escape(plan.graph_fingerprint)}</code>.</p>",
        f"<nav>{nav}</nav>",
        '<h2 id="summary">Summary</h2>',
        f'<pre class="summary">{html.escape(plan.summary())}</pre>',
        '<h2 id="explain">Why this plan</h2>',
        f'<pre class="explain">{html.escape(explain(plan, top=len(plan.alternatives) or 5))}</pre>',
        *parts,
        "</body>",
        "</html>",
        "",
    ])


def write_report(plan: "Plan", path: str | os.PathLike, *, timeline: Iterable[Any] | None = None,
                 measured: Iterable[Any] | None = None, max_micro_batches: int | None = None) -> Path:
    """Write one self-contained HTML page: plan summary, explain(plan) and all the figures.

    Args:
        plan: a planner.Plan.
        path: "report.html" or a directory (report.html inside it); missing directories are created.
        timeline, measured: schedule records, as for planner.app.visualize.visualize.

    Raises:
        ValueError: bad plan, record or path.
    """
    _check_plan(plan)
    out = report_path(path)
    text = render_report(plan, timeline=timeline, measured=measured, max_micro_batches=max_micro_batches)
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot write {out}: {e.strerror or e}; pass a path in a writable directory") from None
    return out
