"""Commands that call a running server or any HTTP endpoint: predict, bench."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    pass
from inferd.cli.common import app, console


@app.command()
def predict(
    model: Annotated[str, typer.Argument(help="Model name.")],
    inputs: Annotated[str | None, typer.Option(help="JSON list of rows.")] = None,
    input_: Annotated[str | None, typer.Option("--input", help="JSON object: one row.")] = None,
    text: Annotated[str | None, typer.Option(help="One text input (field 'text').")] = None,
    features: Annotated[str | None, typer.Option(help="Comma-separated numbers.")] = None,
    file: Annotated[Path | None, typer.Option(help="JSON body file ('-' for stdin).")] = None,
    version: Annotated[str | None, typer.Option("--version", "-v")] = None,
    url: Annotated[str, typer.Option(help="Server URL.")] = "http://127.0.0.1:8000",
    timeout: Annotated[float, typer.Option(help="Seconds.")] = 30.0,
) -> None:
    """Call a running server's predict API and print the JSON reply."""
    import httpx

    body = _predict_body(inputs, input_, text, features, file)
    if version:
        body.setdefault("params", {})["version"] = version
    try:
        reply = httpx.post(
            f"{url.rstrip('/')}/api/v1/models/{model}/predict", json=body, timeout=timeout
        )
    except httpx.HTTPError as exc:
        console.print(f"[red]error:[/red] cannot reach {url}: {escape(str(exc))}")
        raise typer.Exit(1) from None
    print(json.dumps(reply.json(), indent=2))
    if reply.status_code >= 400:
        raise typer.Exit(1)


def _predict_body(
    inputs: str | None,
    input_: str | None,
    text: str | None,
    features: str | None,
    file: Path | None,
) -> dict[str, Any]:
    try:
        if file is not None:
            raw = sys.stdin.read() if str(file) == "-" else file.read_text()
            return dict(json.loads(raw))
        if inputs is not None:
            return {"inputs": json.loads(inputs)}
        if input_ is not None:
            return {"inputs": [json.loads(input_)]}
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise typer.BadParameter(f"not valid JSON: {exc}") from None
    if text is not None:
        return {"inputs": [{"text": text}]}
    if features is not None:
        try:
            return {"inputs": [[float(x) for x in features.split(",")]]}
        except ValueError:
            raise typer.BadParameter("--features takes comma-separated numbers") from None
    raise typer.BadParameter("give one of --inputs, --input, --text, --features, --file")


def _numbers(text: str | None, cast: Any) -> list[Any]:
    if not text:
        return []
    try:
        return [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated numbers, got {text!r}") from None


def _sweep(spec: str) -> tuple[list[int], list[float]]:
    kind, sep, values = spec.partition("=")
    if kind in ("c", "concurrency") and sep:
        return _numbers(values, int), []
    if kind in ("r", "rate") and sep:
        return [], _numbers(values, float)
    raise typer.BadParameter("--sweep takes concurrency=1,8,64 or rate=10,50,100")


@app.command()
def bench(
    url: Annotated[str, typer.Argument(help="Server base URL (or full URL for --target url).")],
    target: Annotated[
        str,
        typer.Option(
            help="predict | v2 | generate | completions | chat | embed | embeddings | url"
        ),
    ] = "url",
    model: Annotated[
        str | None, typer.Option(help="Model name for the target's path/body.")
    ] = None,
    path: Annotated[str | None, typer.Option(help="Override the request path.")] = None,
    concurrency: Annotated[
        str | None,
        typer.Option("--concurrency", "-c", help="Closed loop: connections (list = sweep)."),
    ] = None,
    rate: Annotated[
        str | None,
        typer.Option("--rate", "-r", help="Open loop: Poisson requests/s (list = sweep)."),
    ] = None,
    sweep: Annotated[str | None, typer.Option(help="concurrency=1,8,64 or rate=10,50,100.")] = None,
    duration: Annotated[str | None, typer.Option("--duration", "-d", help="e.g. 20s, 1m.")] = None,
    requests: Annotated[int | None, typer.Option("--requests", "-n", help="Stop after N.")] = None,
    warmup: Annotated[str, typer.Option(help="Discarded warm-up time.")] = "1s",
    timeout: Annotated[str, typer.Option(help="Per-request timeout.")] = "30s",
    body: Annotated[str | None, typer.Option(help="Fixed JSON body.")] = None,
    template: Annotated[str | None, typer.Option(help="JSON body with {{placeholders}}.")] = None,
    payloads: Annotated[Path | None, typer.Option(help="JSONL file, one body per line.")] = None,
    prompt_tokens: Annotated[str, typer.Option(help="32 | uniform:16:256 | normal:128:32")] = "32",
    max_tokens: Annotated[int, typer.Option(help="Generation length for generation targets.")] = 64,
    no_stream: Annotated[bool, typer.Option("--no-stream", help="Generation without SSE.")] = False,
    header: Annotated[list[str] | None, typer.Option("--header", "-H", help="K: V")] = None,
    slo: Annotated[str | None, typer.Option(help="Goodput SLO: ttft=500ms,latency=2s")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for arrivals and templates.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write results as JSON.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG plot.")] = None,
) -> None:
    """Load-test an HTTP inference server (inferd or any other) and report latency figures."""
    from inferd.bench.runner import BenchOptions, run
    from inferd.bench.stats import parse_duration, parse_slo

    conc, rates = _numbers(concurrency, int), _numbers(rate, float)
    if sweep:
        conc, rates = _sweep(sweep)
    headers = {}
    for item in header or []:
        key, sep, value = item.partition(":")
        if not sep:
            raise typer.BadParameter(f"--header takes 'Name: value', got {item!r}")
        headers[key.strip()] = value.strip()
    try:
        opts = BenchOptions(
            url=url,
            target=target,
            model=model,
            path=path,
            concurrency=conc,
            rates=rates,
            duration_s=parse_duration(duration) if duration else (None if requests else 10.0),
            requests=requests,
            warmup_s=parse_duration(warmup),
            timeout_s=parse_duration(timeout),
            body=body,
            template=template,
            payloads=payloads,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            stream=not no_stream,
            headers=headers,
            slo=parse_slo(slo) if slo else None,
            seed=seed,
            json_path=json_out,
            plot_path=plot,
        )
        run(opts, Console())
    except (ValueError, FileNotFoundError, ConnectionError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
