"""`titans inspect`: an HTML report of what the memory does along a text, in three parts: `trace` (read
the text with the model and gather the monitor's numbers), `render` (the page: coloured text, SVG charts,
the `MemoryReport` table) and `cli` (the command)."""

from titans.inference.inspection.cli import check_inspect_args, run_inspect
from titans.inference.inspection.render import render_html, svg_chart
from titans.inference.inspection.trace import Trace, set_surprise_threshold, token_texts, trace_text

__all__ = [
    "Trace",
    "check_inspect_args",
    "render_html",
    "run_inspect",
    "set_surprise_threshold",
    "svg_chart",
    "token_texts",
    "trace_text",
]
