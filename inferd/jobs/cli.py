"""``inferd jobs``: submit, follow, read and cancel batch jobs on a running server."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(help="Batch jobs on a running server: submit, status, results, cancel.",
                  no_args_is_help=True)  # fmt: skip

UrlOpt = Annotated[str, typer.Option(help="Server URL.")]
KeyOpt = Annotated[
    str | None,
    typer.Option("--api-key", envvar="INFERD_API_KEY", help="API key (default: $INFERD_API_KEY)."),
]
DEFAULT_URL = "http://127.0.0.1:8000"


def _client(url: str, api_key: str | None) -> Any:
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=300)


def _call(method: str, url: str, api_key: str | None, path: str, **kw: Any) -> Any:
    import httpx

    try:
        with _client(url, api_key) as client:
            reply = client.request(method, path, **kw)
    except httpx.HTTPError as exc:
        typer.echo(f"error: cannot reach {url}: {exc}", err=True)
        raise typer.Exit(1) from None
    body = reply.json()
    if reply.status_code >= 400:
        error = body.get("error", {})
        typer.echo(
            f"error ({reply.status_code} {error.get('code')}): {error.get('message')}", err=True
        )
        raise typer.Exit(1)
    return body


def _file_inputs(path: Path) -> list[Any]:
    """A local JSON Lines file (one input per line) or a JSON list."""
    text = sys.stdin.read() if str(path) == "-" else path.read_text()
    if text.lstrip().startswith("["):
        return list(json.loads(text))
    inputs = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                inputs.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise typer.BadParameter(f"{path} line {number} is not JSON: {exc}") from None
    return inputs


@app.command("submit")
def submit(
    model: Annotated[str, typer.Argument(help="Model name.")],
    file: Annotated[
        Path | None, typer.Option("--file", "-f", help="Local JSON Lines file ('-': stdin).")
    ] = None,
    uri: Annotated[
        str | None,
        typer.Option(
            help="A file the server reads: a path in its job input folders, or a "
            "URL (s3://, https://...); JSON Lines or CSV."
        ),
    ] = None,
    inputs: Annotated[str | None, typer.Option(help="JSON list of inputs.")] = None,
    version: Annotated[str | None, typer.Option("--version", "-v")] = None,
    callback: Annotated[str | None, typer.Option(help="URL to POST the summary to.")] = None,
    priority: Annotated[str, typer.Option(help="batch, low, normal or high.")] = "batch",
    wait: Annotated[bool, typer.Option(help="Follow the job until it ends.")] = False,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """Submit a batch job; prints its id (and, with --wait, its progress)."""
    body: dict[str, Any] = {"model": model, "priority": priority}
    if sum(x is not None for x in (file, uri, inputs)) != 1:
        raise typer.BadParameter("give one of --file, --uri, --inputs")
    if file is not None:
        body["inputs"] = _file_inputs(file)
    elif uri is not None:
        body["input_uri"] = uri
    else:
        try:
            body["inputs"] = json.loads(inputs or "")
        except json.JSONDecodeError as exc:
            raise typer.BadParameter(f"--inputs is not JSON: {exc}") from None
    if version:
        body["version"] = version
    if callback:
        body["callback_url"] = callback
    job = _call("POST", url, api_key, "/api/v1/batch", json=body)
    if not wait:
        typer.echo(json.dumps(job, indent=2))
        return
    typer.echo(f"{job['batch_id']} queued", err=True)
    _follow(url, api_key, job["batch_id"])


def _follow(url: str, api_key: str | None, job_id: str) -> None:
    while True:
        job = _call("GET", url, api_key, f"/api/v1/batch/{job_id}")
        done = job["succeeded"] + job["failed"]
        eta = f", ETA {job['estimated_time']}" if job["estimated_time"] else ""
        typer.echo(
            f"{job['status']}: {done}/{job['total']} ({job['failed']} failed){eta}", err=True
        )
        if job["status"] in ("succeeded", "failed", "cancelled"):
            typer.echo(json.dumps(job, indent=2))
            if job["status"] != "succeeded":
                raise typer.Exit(1)
            return
        time.sleep(1.0)


@app.command("status")
def status(job_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """A job's status, progress and ETA."""
    typer.echo(json.dumps(_call("GET", url, api_key, f"/api/v1/batch/{job_id}"), indent=2))


@app.command("results")
def results(
    job_id: str,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="File (default stdout).")
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """The results so far, as JSON Lines in input order."""
    import httpx

    out = output.open("wb") if output is not None else sys.stdout.buffer
    try:
        with (
            _client(url, api_key) as client,
            client.stream("GET", f"/api/v1/batch/{job_id}/results") as reply,
        ):
            if reply.status_code >= 400:
                reply.read()
                error = reply.json().get("error", {})
                typer.echo(f"error ({reply.status_code}): {error.get('message')}", err=True)
                raise typer.Exit(1)
            for chunk in reply.iter_bytes():
                out.write(chunk)
    except httpx.HTTPError as exc:
        typer.echo(f"error: cannot reach {url}: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        if output is not None:
            out.close()
        else:
            out.flush()


@app.command("cancel")
def cancel(job_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """Cancel a job: inputs not yet run never run."""
    typer.echo(json.dumps(_call("DELETE", url, api_key, f"/api/v1/batch/{job_id}"), indent=2))
