"""One self-contained HTML report of a plan: summary, alternatives and every picture.

No server and no external files: the pictures are embedded as inline SVG.
"""

from __future__ import annotations

import html
import io
import os
from pathlib import Path
from typing import Any, Iterable

from planner.optimize import explain
from planner.visualize import as_records, figures, make_directory, style

_HEADINGS = {"mesh": "Device mesh (coloured by pipeline stage)", "memory": "Memory per device",
             "time": "Time per step", "alternatives": "Alternatives and why they lost",
             "schedule": "Pipeline schedule"}


def write_report(plan: Any, path: str | os.PathLike, *, timeline: Iterable[Any] | None = None,
                 measured: Iterable[Any] | None = None) -> Path:
    """Write `path` (an .html file; parent directories are created) and return it."""
    out = Path(os.fspath(path)).expanduser()
    if out.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"report path {out} should end in .html")
    make_directory(out.parent)
    if timeline is not None:
        timeline = as_records(timeline, "timeline")
    if measured is not None:
        measured = as_records(measured, "measured timeline")
    sections = []
    with style():
        for name, fig in figures(plan, timeline=timeline, measured=measured).items():
            buf = io.StringIO()
            fig.savefig(buf, format="svg", metadata={"Date": None})
            svg = buf.getvalue()
            svg = svg[svg.index("<svg"):]  # drop the XML prologue: inline SVG in HTML
            sections.append(f"<section><h2>{html.escape(_HEADINGS.get(name, name))}</h2>{svg}</section>")
    title = f"meshplan plan: {plan.model_class.rsplit('.', 1)[-1]} on {plan.cluster.name}"
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}} pre{{background:#f6f6f6;padding:1em;
overflow-x:auto}} svg{{max-width:100%;height:auto}} section{{margin:2em 0}}</style></head>
<body><h1>{html.escape(title)}</h1>
<h2>Summary</h2><pre>{html.escape(plan.summary())}</pre>
<h2>Alternatives</h2><pre>{html.escape(explain(plan))}</pre>
{''.join(sections)}
</body></html>
"""
    try:
        out.write_text(doc)
    except OSError as e:
        raise ValueError(f"cannot write {out}: {e.strerror or e}") from None
    return out
