"""Showing a benchmark's figures: rich tables for the terminal, JSON and PNG files.

Reads :class:`~inferd.bench.stats.Summary` objects and timeline rows and computes
nothing new, so the terminal, the JSON file and the plots always agree. matplotlib is
optional and imported only when a plot is asked for.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from inferd.bench.stats import Summary

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_DIST_KEYS = ("p50", "p90", "p95", "p99", "max")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}" if value >= 100 else f"{value:.2f}"


def _dist(dist: dict[str, float | None]) -> str:
    if dist.get("p50") is None:
        return "-"
    parts = [f"{key} {_ms(dist.get(key))}" for key in _DIST_KEYS]
    return "  ".join(parts) + f"  (mean {_ms(dist.get('mean'))})"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key}: {n:,}" for key, n in counts.items()) or "-"


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def render_summary(summary: Summary, title: str) -> Table:
    """One load level as a two-column table (distributions in milliseconds)."""
    s = summary
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value")
    table.add_row("requests", f"{s.requests:,} in {s.duration_s:.2f} s")
    table.add_row("successes", f"{s.successes:,} ({_pct(s.successes, s.requests)})")
    errors = f"{s.errors:,}" + (f"  ({_counts(s.errors_by_kind)})" if s.errors else "")
    table.add_row("errors", f"[red]{errors}[/red]" if s.errors else errors)
    table.add_row("status codes", _counts(s.status_counts))
    table.add_row("throughput", f"{s.rps:,.1f} req/s  ({s.success_rps:,.1f} ok/s)")
    table.add_row("latency ms", _dist(s.latency))
    if s.ttft is not None:
        table.add_row("ttft ms", _dist(s.ttft))
    if s.itl is not None:
        table.add_row("itl ms", _dist(s.itl))
    if s.output_tokens is not None:
        table.add_row("output tokens", f"{s.output_tokens:,}  ({s.output_tokens_per_s:,.1f} tok/s)")
    if s.client_cpu is not None:
        per_request = (
            f", {s.client_cpu * s.duration_s / s.requests * 1e6:.1f} µs/request"
            if s.requests
            else ""
        )
        table.add_row("load generator", f"{s.client_cpu:.0%} of a core{per_request}")
    if s.goodput_requests is not None:
        slo = ", ".join(f"{k}<={v * 1000:g}ms" for k, v in (s.slo_s or {}).items())
        table.add_row(
            "goodput",
            f"{s.goodput_requests:,} req, {s.goodput_rps:,.1f}/s "
            f"({_pct(s.goodput_requests, s.successes)} of successes; SLO {slo or 'none'})",
        )
    return table


def render_sweep(rows: Sequence[tuple[str, Summary]]) -> Table:
    """One row per load level; stream and goodput columns only when some level has them."""
    streams = any(s.ttft is not None for _, s in rows)
    goodput = any(s.goodput_requests is not None for _, s in rows)
    table = Table(title="sweep", title_justify="left")
    for name in ("level", "req/s", "success", "errors", "p50 ms", "p99 ms"):
        table.add_column(name, justify="left" if name == "level" else "right")
    if streams:
        for name in ("ttft p50", "ttft p99", "tok/s"):
            table.add_column(name, justify="right")
    if goodput:
        table.add_column("goodput/s", justify="right")
    for label, s in rows:
        cells = [
            label,
            f"{s.rps:,.1f}",
            _pct(s.successes, s.requests),
            f"{s.errors:,}",
            _ms(s.latency.get("p50")),
            _ms(s.latency.get("p99")),
        ]
        if streams:
            ttft = s.ttft or {}
            tokens = s.output_tokens_per_s
            cells += [
                _ms(ttft.get("p50")),
                _ms(ttft.get("p99")),
                "-" if tokens is None else f"{tokens:,.1f}",
            ]
        if goodput:
            cells.append("-" if s.goodput_rps is None else f"{s.goodput_rps:,.1f}")
        table.add_row(*cells)
    return table


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Writes ``payload`` as indented JSON, atomically (a crash leaves no half file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# --- plots ---------------------------------------------------------------------------------


def _figure(rows: int) -> Figure:
    """A figure drawn by the Agg (PNG) canvas, without touching pyplot's global backend."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install matplotlib") from exc
    figure = Figure(figsize=(9, 3.2 * rows + 0.8), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _values(values: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else v for v in values]


def _latency_scale(axes: Axes, values: Sequence[float]) -> None:
    # Past saturation p99 grows by orders of magnitude; a log axis keeps p50 readable.
    finite = [v for v in values if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 50:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        axes.set_yscale("log")
        # Ticks at 1-2-5 steps labelled 200 rather than 2x10^2.
        axes.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axes.yaxis.set_minor_formatter(NullFormatter())


def plot_sweep(rows: Sequence[tuple[str, Summary]], path: Path, x_label: str = "load") -> None:
    """PNG: latency p50/p90/p99 per load level, achieved throughput on a second axis.

    Levels are placed evenly in the given order and labelled with their names
    (``c=64``, ``rate=100/s``), which suits the usual doubling sweeps.
    """
    figure = _figure(1)
    axes = figure.add_subplot()
    x = list(range(len(rows)))
    plotted: list[float] = []
    for key, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^-")):
        ys = _values([s.latency.get(key) for _, s in rows])
        plotted += ys
        axes.plot(x, ys, style, label=f"latency {key}")
    _latency_scale(axes, plotted)
    axes.set_xticks(x, [label for label, _ in rows])
    axes.set_xlabel(x_label)
    axes.set_ylabel("latency (ms)")
    axes.grid(True, alpha=0.3)
    throughput = axes.twinx()
    throughput.plot(x, [s.success_rps for _, s in rows], "d:", color="tab:green", label="ok/s")
    if any(s.goodput_rps is not None for _, s in rows):
        goodput = _values([s.goodput_rps for _, s in rows])
        throughput.plot(x, goodput, "x:", color="tab:olive", label="goodput/s")
    throughput.set_ylabel("throughput (req/s)")
    throughput.set_ylim(bottom=0)
    lines, labels = axes.get_legend_handles_labels()
    more_lines, more_labels = throughput.get_legend_handles_labels()
    # Below the axes: inside, it would hide whichever of the two axes' lines it covers.
    figure.legend(
        lines + more_lines,
        labels + more_labels,
        loc="outside lower center",
        ncols=len(lines + more_lines),
        fontsize="small",
    )
    axes.set_title("latency and throughput per load level")
    figure.savefig(Path(path), dpi=110)


def plot_timeline(timeline: Sequence[dict[str, Any]], path: Path) -> None:
    """PNG: latency p50/p99 over time (top) and completed requests/s and errors/s (bottom)."""
    figure = _figure(2)
    top, bottom = figure.subplots(2, 1, sharex=True)
    t = [row["t"] for row in timeline]
    p50 = _values([row.get("p50_ms") for row in timeline])
    p99 = _values([row.get("p99_ms") for row in timeline])
    top.plot(t, p50, "-", label="p50")
    top.plot(t, p99, "-", label="p99")
    _latency_scale(top, p50 + p99)
    top.set_ylabel("latency (ms)")
    top.legend(loc="upper left", fontsize="small")
    top.grid(True, alpha=0.3)
    bucket_s = t[1] - t[0] if len(t) > 1 else 1.0
    bottom.plot(t, [row["rps"] for row in timeline], "-", label="completed/s")
    bottom.plot(
        t, [row["errors"] / bucket_s for row in timeline], "-", color="tab:red", label="errors/s"
    )
    bottom.set_ylabel("requests/s")
    bottom.set_xlabel("time since start (s)")
    bottom.set_ylim(bottom=0)
    bottom.legend(loc="upper left", fontsize="small")
    bottom.grid(True, alpha=0.3)
    top.set_title("latency and throughput over time")
    figure.savefig(Path(path), dpi=110)
