"""``inferd bench``: build the requests, run each load level, report.

Levels run one after another in this process, each on a fresh event loop (uvloop when
installed). Ctrl-C stops the current level; the figures collected so far are printed
and saved as usual.
"""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from inferd.bench.connection import encode_request, request_head
from inferd.bench.loadgen import LoadGenerator, LoadResult, LoadSpec
from inferd.bench.payloads import (
    FixedPayload,
    JsonlPayloads,
    PayloadSource,
    PromptLengths,
    TemplatePayloads,
)
from inferd.bench.report import plot_sweep, plot_timeline, render_summary, render_sweep, write_json
from inferd.bench.stats import Summary, summarize, timeline
from inferd.bench.targets import preset, split_url

CLIENT_CPU_WARN = 0.9
"""Above this share of one core, the load generator warns that it may be the bottleneck."""


@dataclass
class BenchOptions:
    url: str
    target: str = "url"
    model: str | None = None
    path: str | None = None
    concurrency: list[int] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    duration_s: float | None = 10.0
    requests: int | None = None
    warmup_s: float = 1.0
    timeout_s: float = 30.0
    body: str | None = None
    template: str | None = None
    payloads: Path | None = None
    prompt_tokens: str = "32"
    max_tokens: int = 64
    stream: bool = True
    headers: dict[str, str] = field(default_factory=dict)
    slo: dict[str, float] | None = None
    seed: int | None = None
    json_path: Path | None = None
    plot_path: Path | None = None


def build_requests(opts: BenchOptions) -> tuple[str, int, Callable[[], bytes]]:
    """Host, port and a function giving the bytes of the next request."""
    target = preset(opts.target, opts.model, opts.max_tokens, opts.stream)
    host, port, url_path = split_url(opts.url)
    if opts.path:
        path = opts.path
    elif target.name == "url":
        path = url_path
    else:
        path = url_path.rstrip("/") + target.path
    headers = {"Content-Type": "application/json", "Accept": "*/*", **opts.headers}
    head = request_head(target.method, path, f"{host}:{port}", headers)
    source = _payloads(opts, target.template)
    if isinstance(source, FixedPayload):
        request = encode_request(head, source.body)
        return host, port, lambda: request
    return host, port, lambda: encode_request(head, source.next())


def _payloads(opts: BenchOptions, default: dict[str, Any] | None) -> PayloadSource:
    given = [x for x in (opts.body, opts.template, opts.payloads) if x is not None]
    if len(given) > 1:
        raise ValueError("give only one of --body, --template, --payloads")
    if opts.payloads is not None:
        return JsonlPayloads(opts.payloads)
    if opts.body is not None:
        json.loads(opts.body)  # fail early on a typo, not on every request
        return FixedPayload(opts.body.encode())
    template = opts.template if opts.template is not None else default
    if template is None:
        raise ValueError("this target needs a request body: --body, --template or --payloads")
    source = TemplatePayloads(
        template, seed=opts.seed, prompt_lengths=PromptLengths.parse(opts.prompt_tokens)
    )
    return source if _has_placeholders(template) else FixedPayload(source.next())


def _has_placeholders(template: str | dict[str, Any]) -> bool:
    text = template if isinstance(template, str) else json.dumps(template)
    return "{{" in text


def levels(opts: BenchOptions) -> list[tuple[str, dict[str, Any]]]:
    if opts.concurrency and opts.rates:
        raise ValueError("give --concurrency or --rate, not both")
    if opts.rates:
        return [(f"rate={r:g}/s", {"rate": r}) for r in opts.rates]
    return [(f"c={c}", {"concurrency": c}) for c in (opts.concurrency or [8])]


def run(opts: BenchOptions, console: Console) -> list[tuple[str, Summary]]:
    host, port, next_request = build_requests(opts)
    # https: the server's certificate checked against the system's CAs (or SSL_CERT_FILE's)
    tls = ssl.create_default_context() if opts.url.startswith("https://") else None
    results: list[tuple[str, Summary]] = []
    timelines: dict[str, list[dict[str, Any]]] = {}
    for label, load in levels(opts):
        spec = LoadSpec(
            host,
            port,
            next_request,
            duration_s=opts.duration_s,
            requests=opts.requests,
            warmup_s=opts.warmup_s,
            timeout_s=opts.timeout_s,
            seed=opts.seed,
            ssl=tls,
            **load,
        )
        result = _run_level(spec, label, console)
        summary = summarize(result.samples, result.duration_s, opts.slo)
        if result.wall_s > 0:
            summary.client_cpu = round(result.cpu_s / result.wall_s, 3)
        results.append((label, summary))
        timelines[label] = timeline(result.samples)
        console.print(render_summary(summary, f"{opts.url} {label}"))
        if (summary.client_cpu or 0) > CLIENT_CPU_WARN:
            console.print(
                f"[yellow]the load generator kept {summary.client_cpu:.0%} of a core busy: "
                "it may be what limits these figures (run it on other cores or another "
                "machine)[/yellow]"
            )
        if result.connect_errors:
            console.print(f"[yellow]{result.connect_errors} connection attempts failed[/yellow]")
        if result.unsent_arrivals:
            console.print(
                f"[yellow]{result.unsent_arrivals} arrivals were still queued in "
                "the client when the run ended (the server fell behind)[/yellow]"
            )
        if result.interrupted:
            console.print("[yellow]interrupted: figures above are what was collected[/yellow]")
            break
    if len(results) > 1:
        console.print(render_sweep(results))
    _save(opts, results, timelines)
    return results


def _run_level(spec: LoadSpec, label: str, console: Console) -> LoadResult:
    generator = LoadGenerator(spec)

    async def main() -> LoadResult:
        loop = asyncio.get_running_loop()
        task = loop.create_task(generator.run())
        loop.add_signal_handler(signal.SIGINT, task.cancel)
        with Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            auto_refresh=False,  # no refresh thread taking the GIL from the load loop
        ) as progress:
            bar = progress.add_task("", total=spec.duration_s or spec.requests or 1)
            started = time.perf_counter()
            while not task.done():
                elapsed = time.perf_counter() - started
                done = generator.completed
                progress.update(
                    bar, completed=elapsed if spec.duration_s else done, description=f"{done} done"
                )
                progress.refresh()
                await asyncio.wait([task], timeout=0.25)
        loop.remove_signal_handler(signal.SIGINT)
        return task.result()

    # The run allocates one small object per request and makes no cycles: the cyclic
    # collector would only rescan the growing sample list, in the middle of the load.
    gc.disable()
    try:
        import uvloop

        return uvloop.run(main())
    except ImportError:  # pragma: no cover - uvloop ships with inferd on Linux
        return asyncio.run(main())
    finally:
        gc.enable()


def _save(
    opts: BenchOptions,
    results: list[tuple[str, Summary]],
    timelines: dict[str, list[dict[str, Any]]],
) -> None:
    if opts.json_path is not None:
        write_json(
            opts.json_path,
            {
                "url": opts.url,
                "target": opts.target,
                "model": opts.model,
                "levels": [{"level": label, **s.to_dict()} for label, s in results],
                "timeline": timelines,
            },
        )
    if opts.plot_path is not None and results:
        if len(results) > 1:
            plot_sweep(results, opts.plot_path)
        else:
            plot_timeline(timelines[results[0][0]], opts.plot_path)
