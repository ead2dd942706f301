"""The ``inferd`` command line. The only place that configures logging for the server."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

import inferd
from inferd.config import Settings, load_settings
from inferd.errors import InferdError
from inferd.jobs import cli as jobs_cli

if TYPE_CHECKING:
    from inferd.registry.deployments import DeploymentRecord, TrafficRecord

app = typer.Typer(
    help="inferd: serve any model fast, versioned and observable.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(
    help="The model registry: push, list, show, load, unload.", no_args_is_help=True
)
app.add_typer(models_app, name="models")
keys_app = typer.Typer(help="API keys: create, list, revoke.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(jobs_cli.app, name="jobs")
console = Console(stderr=True)

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="YAML settings file.")]
DataDirOpt = Annotated[
    Path | None, typer.Option("--data-dir", help="Data folder (INFERD_DATA_DIR).")
]


def _version_callback(value: bool) -> None:
    if value:
        print(f"inferd {inferd.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version_callback, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    pass


def _settings(config: Path | None, **overrides: Any) -> Settings:
    try:
        return load_settings(config, **overrides)
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


@app.command()
def serve(
    demo: Annotated[bool, typer.Option(help="Build, register and serve the demo models.")] = False,
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (default 8000).")] = None,
    grpc_port: Annotated[
        int | None, typer.Option(help="gRPC port (default 8001; -1: no gRPC).")
    ] = None,
    workers: Annotated[int | None, typer.Option(help="Gateway processes.")] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Start the server: gateway processes on HOST:PORT (HTTP) and HOST:GRPC_PORT (the
    Open Inference Protocol's gRPC service), and one replica per model."""
    import asyncio

    from inferd.observability.logging import configure_logging
    from inferd.server import serve as run_server

    settings = _settings(
        config,
        host=host,
        port=port,
        grpc_port=grpc_port,
        gateway_workers=workers,
        data_dir=data_dir,
    )
    configure_logging(settings.log_level, settings.log_json, "server")
    try:
        import uvloop

        uvloop.run(run_server(settings, demo=demo, progress=_progress))
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(run_server(settings, demo=demo, progress=_progress))


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _registry(config: Path | None, data_dir: Path | None) -> Any:
    from inferd.registry import Registry

    return Registry.from_settings(_settings(config, data_dir=data_dir))


@contextmanager
def _errors() -> Any:
    try:
        yield
    except InferdError as exc:
        console.print(f"[red]error ({exc.status_code} {exc.code}):[/red] {exc.message}")
        raise typer.Exit(1) from None


def _batching_option(text: str) -> dict[str, Any]:
    """``--batching`` JSON, checked against the batching settings."""
    from pydantic import ValidationError

    from inferd.config import BatchingConfig

    try:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        BatchingConfig(**value)
    except (ValueError, ValidationError) as exc:
        console.print(f"[red]error:[/red] --batching: {exc}")
        raise typer.Exit(2) from None
    return value


def _parse_meta(items: list[str]) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--meta expects key=value, got {item!r}")
        try:
            meta[key] = json.loads(value)
        except json.JSONDecodeError:
            meta[key] = value
    return meta


@models_app.command("push")
def models_push(
    name: Annotated[str, typer.Argument(help="Model name.")],
    path: Annotated[Path, typer.Argument(exists=True, help="Artifact file or folder.")],
    version: Annotated[str, typer.Option("--version", "-v", help="Version label, e.g. v3.1.")],
    framework: Annotated[str | None, typer.Option(help="Runtime; detected when omitted.")] = None,
    meta: Annotated[list[str] | None, typer.Option("--meta", help="key=value metadata.")] = None,
    signature: Annotated[Path | None, typer.Option(help="JSON file with the signature.")] = None,
    description: Annotated[str | None, typer.Option(help="Model description.")] = None,
    owner: Annotated[str | None, typer.Option(help="Model owner.")] = None,
    max_batch_size: Annotated[int | None, typer.Option(help="Default batch rows.")] = None,
    max_wait_ms: Annotated[float | None, typer.Option(help="Default batch wait.")] = None,
    replicas: Annotated[int | None, typer.Option(help="Default replica count.")] = None,
    batching_json: Annotated[
        str | None,
        typer.Option(
            "--batching",
            help="Default batching as JSON, e.g. '{\"max_queue_rows\": 1024}' (any batching "
            "setting).",
        ),
    ] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Register a new immutable version: inspect it, copy it to the store, record it."""
    from inferd.runtimes import inspect_artifact
    from inferd.runtimes.base import Signature

    metadata = _parse_meta(meta or [])
    declared = Signature.from_dict(json.loads(signature.read_text())) if signature else None
    batching = {
        k: v
        for k, v in (
            ("max_batch_size", max_batch_size),
            ("max_wait_ms", max_wait_ms),
            ("replicas", replicas),
        )
        if v
    }
    if batching_json:
        batching = {**_batching_option(batching_json), **batching}
    registry = _registry(config, data_dir)
    with _errors(), _as_folder(path) as folder:
        with console.status(f"loading {path.name} to check it and read its signature ..."):
            try:
                found, sig = inspect_artifact(folder, framework, metadata, declared)
            except Exception as exc:  # any loader error: say what failed, no traceback
                console.print(f"[red]error:[/red] cannot load {path}: {type(exc).__name__}: {exc}")
                raise typer.Exit(1) from None
        record = registry.push(
            name,
            folder,
            version,
            framework=found,
            signature=sig,
            metadata=metadata,
            description=description,
            owner=owner,
            batching=batching or None,
        )
    console.print(
        f"registered [bold]{name}:{version}[/bold] ({found}), sha256 {record.sha256[:12]}"
    )
    print(json.dumps(record.to_dict(), indent=2))


@models_app.command("optimize")
def models_optimize(
    name: Annotated[str, typer.Argument(help="Model name.")],
    version: Annotated[str, typer.Argument(help="The version to optimize.")],
    int8: Annotated[
        bool, typer.Option("--int8", help="PyTorch dynamic int8 quantization (transformers).")
    ] = False,
    all_layers: Annotated[
        bool,
        typer.Option(
            "--all-layers",
            help="Quantize the feed-forward down-projections too (faster, less accurate).",
        ),
    ] = False,
    to: Annotated[
        str | None, typer.Option("--to", help="The new version's label (default VERSION-int8).")
    ] = None,
    eval_file: Annotated[
        Path | None,
        typer.Option(
            "--eval",
            exists=True,
            dir_okay=False,
            help="CSV or JSONL of texts (and labels) to measure on; default: the bundled reviews.",
        ),
    ] = None,
    threads: Annotated[int, typer.Option(help="Threads while measuring.", min=1)] = 1,
    batch_size: Annotated[int, typer.Option(help="Batch size while measuring.", min=1)] = 32,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Register a faster variant of a version, with its measured speed-up and quality."""
    from inferd.runtimes.optimize import METHOD, METHOD_ALL, measure_int8, read_eval_set

    if not int8:
        console.print("[red]error:[/red] say which optimization: --int8")
        raise typer.Exit(2)
    registry = _registry(config, data_dir)
    with _errors():
        record = registry.get_version(name, version)
        if record.framework != "transformers":
            console.print(
                f"[red]error:[/red] {name}:{version} is {record.framework}; --int8 applies to "
                "transformers models (ONNX models: quantize with onnxruntime and push)"
            )
            raise typer.Exit(1)
        if record.metadata.get("quantization"):
            console.print(f"[red]error:[/red] {name}:{version} is already quantized")
            raise typer.Exit(1)
        evalset = read_eval_set(eval_file)
        new_version = to or f"{version}-int8"
        with console.status(
            f"measuring float32 and int8 on {len(evalset.texts)} texts "
            f"({METHOD_ALL if all_layers else METHOD}) ..."
        ):
            measured = measure_int8(
                record.artifact_path,
                record.metadata,
                evalset,
                threads,
                batch_size,
                every_layer=all_layers,
            )
        metadata = {
            **record.metadata,
            "quantization": measured["quantization"],
            "optimized_from": version,
            "optimization": measured,
        }
        new = registry.push(
            name,
            record.artifact_path,
            new_version,
            framework=record.framework,
            signature=record.signature,
            metadata=metadata,
            batching=record.batching,
        )
    quality = {
        k: v for k, v in measured.items() if any(w in k for w in ("cosine", "accura", "agree"))
    }
    console.print(
        f"registered [bold]{name}:{new_version}[/bold] (int8 of {version}): "
        f"{measured['speedup']}x the float32 speed "
        f"({measured['int8_texts_per_s']} vs {measured['fp32_texts_per_s']} texts/s), "
        + ", ".join(f"{k} {v}" for k, v in quality.items())
    )
    print(json.dumps(new.to_dict(), indent=2))


@contextmanager
def _as_folder(path: Path) -> Any:
    if path.is_dir():
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="inferd-push-") as tmp:
        shutil.copy2(path, Path(tmp) / path.name)
        yield Path(tmp)


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Argument(help="What the key is for, e.g. checkout-service.")],
    scope: Annotated[
        list[str] | None, typer.Option("--scope", help="infer (default) or admin; repeatable.")
    ] = None,
    model: Annotated[
        list[str] | None,
        typer.Option("--model", help="Only these models (repeatable; default: all)."),
    ] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Create an API key; the key is printed (on stdout) this once, only its hash is kept."""
    with _errors(), _registry(config, data_dir) as registry:
        record, key = registry.keys.create(name, scope or ["infer"], model or None, _ACTOR)
    console.print(
        f"created key [bold]{record.key_id}[/bold] ({name}) with scopes {', '.join(record.scopes)}"
        + (f", models {', '.join(record.models)}" if record.models else "")
        + "; store it now: it is not shown again"
    )
    print(key)


@keys_app.command("list")
def keys_list(config: ConfigOpt = None, data_dir: DataDirOpt = None) -> None:
    """Every API key (never the key itself), revoked ones too."""
    with _errors(), _registry(config, data_dir) as registry:
        records = registry.keys.list_all()
    table = Table("key id", "name", "scopes", "models", "created (UTC)", "by", "revoked")
    for r in records:
        table.add_row(
            r.key_id, r.name, ", ".join(r.scopes), ", ".join(r.models or ["all"]),
            r.created_at.strftime("%Y-%m-%d %H:%M"), r.created_by,
            r.revoked_at.strftime("%Y-%m-%d %H:%M") if r.revoked_at else "-",
        )  # fmt: skip
    Console().print(table)


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (the 12 hex digits after ik_).")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Revoke a key: servers refuse it within ``auth.cache_s`` seconds (5)."""
    with _errors(), _registry(config, data_dir) as registry:
        registry.keys.revoke(key_id)
    console.print(f"revoked key [bold]{key_id}[/bold]")


@models_app.command("list")
def models_list(config: ConfigOpt = None, data_dir: DataDirOpt = None) -> None:
    """Registered models and their versions."""
    table = Table("model", "framework", "versions", "latest", "description")
    for m in _registry(config, data_dir).list_models():
        latest = m.versions[-1].version if m.versions else "-"
        table.add_row(
            m.name,
            m.framework or "-",
            ", ".join(v.version for v in m.versions),
            latest,
            m.description or "",
        )
    Console().print(table)


@models_app.command("show")
def models_show(
    name: str,
    version: Annotated[str | None, typer.Option("--version", "-v")] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """One model (or one version) as JSON: signature, metadata, checksum."""
    registry = _registry(config, data_dir)
    with _errors():
        if version:
            print(json.dumps(registry.get_version(name, version).to_dict(), indent=2))
        else:
            model = registry.get_model(name)
            print(
                json.dumps(
                    {
                        "name": model.name,
                        "description": model.description,
                        "framework": model.framework,
                        "owner": model.owner,
                        "loaded": model.loaded,
                        "versions": [v.to_dict() for v in model.versions],
                    },
                    indent=2,
                )
            )


def _set_loaded(name: str, loaded: bool, config: Path | None, data_dir: Path | None) -> None:
    registry = _registry(config, data_dir)
    with _errors():
        registry.set_loaded(name, loaded)
    action = "serves its newest version" if loaded else "stops its replicas"
    console.print(
        f"[bold]{name}[/bold] marked {'loaded' if loaded else 'unloaded'}; a running server "
        f"{action} on its next reconcile (POST /v2/repository/models/{name}/"
        f"{'load' if loaded else 'unload'} also waits for it)"
    )


@models_app.command("load")
def models_load(name: str, config: ConfigOpt = None, data_dir: DataDirOpt = None) -> None:
    """Mark a model loaded: the server serves its newest version (the default)."""
    _set_loaded(name, True, config, data_dir)


@models_app.command("unload")
def models_unload(name: str, config: ConfigOpt = None, data_dir: DataDirOpt = None) -> None:
    """Mark a model unloaded: the server stops its replicas and keeps it so (restarts too)."""
    _set_loaded(name, False, config, data_dir)


# -- deployments: written to the registry; a running server acts on its next reconcile ----

_ACTOR = "cli"
_PICKED_UP = "a running server acts on it at its next reconcile"


def _split_text(split: dict[str, int]) -> str:
    return " ".join(f"{v}={pct}%" for v, pct in split.items()) or "-"


def _parse_split(items: list[str]) -> dict[str, int]:
    """``["v1=90", "v2=10"]`` -> ``{"v1": 90, "v2": 10}``; the registry checks the values."""
    split: dict[str, int] = {}
    for item in items:
        version, _, pct = item.rpartition("=")
        if not version or not pct.removeprefix("-").isdigit():
            raise typer.BadParameter(f"expected VERSION=PERCENT, e.g. v3.1=10, got {item!r}")
        split[version] = int(pct)
    return split


@app.command()
def deploy(
    model: Annotated[str, typer.Argument(help="Model name.")],
    version: Annotated[str, typer.Argument(help="A registered version.")],
    traffic: Annotated[
        int | None,
        typer.Option(
            help="Its percent of the traffic (default 100; canary: its first step; shadow: "
            "the percent of requests mirrored to it)."
        ),
    ] = None,
    replicas: Annotated[int | None, typer.Option(help="Replica processes.")] = None,
    gpu: Annotated[str | None, typer.Option(help="GPU type, e.g. A100.")] = None,
    strategy: Annotated[
        str, typer.Option(help="How to roll out: rolling, blue-green, canary or shadow.")
    ] = "rolling",
    keep_old_s: Annotated[
        float | None,
        typer.Option(
            help="blue-green, canary: seconds the replaced versions stay after the switch "
            "(default 300)."
        ),
    ] = None,
    steps: Annotated[
        str | None, typer.Option(help="canary: percents, e.g. 1,10,50,100 (the default).")
    ] = None,
    step_s: Annotated[
        float | None, typer.Option(help="canary: analysis window of each step (default 60).")
    ] = None,
    webhook: Annotated[
        str | None, typer.Option(help="canary: URL that must answer 2xx to each step's figures.")
    ] = None,
    rollout: Annotated[
        str | None,
        typer.Option(
            help="More strategy settings as JSON, e.g. '{\"max_latency_increase\": 0.2}'."
        ),
    ] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Deploy a registered version with TRAFFIC % of the model's requests; the other
    deployed versions share the rest in proportion. A canary moves through its steps on
    its own while its analysis passes, and rolls back when it does not."""
    settings = _rollout_settings(rollout, keep_old_s, steps, step_s, webhook)
    with _errors(), _registry(config, data_dir) as registry:
        registry.deployments.deploy(
            model,
            version,
            traffic_pct=traffic,
            replicas=replicas,
            gpu_type=gpu,
            strategy=strategy,
            rollout=settings or None,
            actor=_ACTOR,
        )
        change = registry.deployments.history(model, 1)[0]
    console.print(
        f"deployed [bold]{model}:{version}[/bold] ({strategy}); traffic "
        f"{_split_text(change.split)} (revision {change.revision}); {_PICKED_UP}"
    )


def _rollout_settings(
    raw: str | None,
    keep_old_s: float | None,
    steps: str | None,
    step_s: float | None,
    webhook: str | None,
) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if raw is not None:
        try:
            settings = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise typer.BadParameter(f"--rollout is not JSON: {exc}") from None
        if not isinstance(settings, dict):
            raise typer.BadParameter("--rollout must be a JSON object")
    if steps is not None:
        try:
            settings["steps"] = [int(x) for x in steps.split(",")]
        except ValueError:
            message = f"--steps must be percents like 1,10,50,100: {steps!r}"
            raise typer.BadParameter(message) from None
    for key, value in (("keep_old_s", keep_old_s), ("step_s", step_s), ("webhook", webhook)):
        if value is not None:
            settings[key] = value
    return settings


@app.command("traffic")
def traffic_cmd(
    model: Annotated[str, typer.Argument(help="Model name.")],
    weights: Annotated[list[str], typer.Argument(help="VERSION=PERCENT ..., summing to 100.")],
    revision: Annotated[
        int | None, typer.Option(help="Refuse if the split changed since this revision.")
    ] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Set a model's traffic split; deployed versions left out get 0 %."""
    split = _parse_split(weights)
    with _errors(), _registry(config, data_dir) as registry:
        change = registry.deployments.set_traffic(model, split, actor=_ACTOR, revision=revision)
    console.print(
        f"[bold]{model}[/bold] traffic {_split_text(change.split)} "
        f"(revision {change.revision}); {_PICKED_UP}"
    )


@app.command()
def rollback(
    model: Annotated[str, typer.Argument(help="Model name.")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Back to the last stable split: one still-deployed version at 100 %."""
    with _errors(), _registry(config, data_dir) as registry:
        change = registry.deployments.rollback(model, actor=_ACTOR)
    console.print(
        f"[bold]{model}[/bold] rolled back ({change.detail}): traffic "
        f"{_split_text(change.split)} (revision {change.revision}); {_PICKED_UP}"
    )


@app.command()
def undeploy(
    model: Annotated[str, typer.Argument(help="Model name.")],
    version: Annotated[str, typer.Argument(help="A deployed version taking no traffic.")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Remove a deployment: it drains, then the server stops its replicas."""
    with _errors(), _registry(config, data_dir) as registry:
        registry.deployments.undeploy(model, version, actor=_ACTOR)
    console.print(f"[bold]{model}:{version}[/bold] draining; {_PICKED_UP}")


@app.command()
def deployments(
    model: Annotated[str | None, typer.Argument(help="One model, with its history.")] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Deployed versions with their status, replicas and traffic (models without
    deployments: automatic, their newest version takes all traffic)."""
    with _errors(), _registry(config, data_dir) as registry:
        records = [registry.get_model(model)] if model else registry.list_models()
        rows = registry.deployments.list_all(model)
        history = registry.deployments.history(model) if model else []
    table = Table("model", "version", "status", "replicas", "gpu", "traffic", "rollout")
    deployed = {r.model_name for r in rows}
    for r in rows:
        replicas = str(r.replicas) if r.replicas is not None else "default"
        table.add_row(
            r.model_name, r.version, r.status, replicas, r.gpu_type or "-", f"{r.traffic_pct}%",
            _rollout_text(r),
        )  # fmt: skip
    for m in records:
        if m.name not in deployed and m.versions:
            status, share = ("automatic", "100%") if m.loaded else ("unloaded", "-")
            table.add_row(m.name, m.versions[-1].version, status, "default", "-", share, "-")
    out = Console()
    out.print(table)
    if history:
        out.print(_history_table(history))


def _rollout_text(record: DeploymentRecord) -> str:
    """A deployment's strategy and where it stands, in a few words."""
    if (shadow := record.shadow) is not None:
        return f"shadow, mirrors {shadow.mirror_pct}%"
    if (canary := record.canary) is not None:
        text = f"canary {canary.state.value}, step {canary.step + 1}/{len(canary.steps)}"
        return f"{text}: {canary.reason}" if canary.reason else text
    if (blue_green := record.blue_green) is not None:
        return "blue-green, switched" if blue_green.switched_at else "blue-green, waiting"
    return record.strategy.value


def _history_table(history: list[TrafficRecord]) -> Table:
    table = Table("revision", "when (UTC)", "reason", "actor", "traffic", "detail", title="history")
    for h in history:
        when = h.created_at.strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            str(h.revision), when, h.reason, h.actor, _split_text(h.split), h.detail or ""
        )
    return table


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
        console.print(f"[red]error:[/red] cannot reach {url}: {exc}")
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
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


def main() -> None:
    app()
