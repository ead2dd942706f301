"""``inferd models``: push, optimize, list, show, load, unload."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    pass
from inferd.cli.common import (
    ApiKeyOpt,
    ConfigOpt,
    DataDirOpt,
    UrlOpt,
    _errors,
    _registry,
    _settings,
    console,
    models_app,
)


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
    source: Annotated[
        str,
        typer.Argument(
            help="Artifact file or folder, or a URI to import: s3://bucket/key, or MLflow's "
            "models:/name/version, models:/name@alias, runs:/run_id/path."
        ),
    ],
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
    deploy: Annotated[
        bool,
        typer.Option(
            "--deploy",
            help="Give the new version all the traffic at once (default: a model that "
            "already serves a version keeps serving it; deploy the new one with "
            "'inferd deploy').",
        ),
    ] = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Register a new immutable version: inspect it, copy it to the store, record it.
    The first version of a new model serves at once; a later one takes no traffic
    until it is deployed (or pushed with --deploy). With --url, upload it to that
    server (or have it import the URI), which checks and registers it."""
    from inferd.shapes.tensors import Signature

    uri = source if _is_uri(source) else None
    path = Path(source)
    if uri is None and not path.exists():
        console.print(f"[red]error:[/red] {source} does not exist")
        raise typer.Exit(2)

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
    if url:
        options = {
            "framework": framework,
            "metadata": metadata,
            "signature": declared.to_dict() if declared else None,
            "description": description,
            "owner": owner,
            "batching": batching or None,
            "deploy": deploy,
        }
        with _remote(url, api_key) as remote:
            if uri is not None:
                with console.status(f"the server imports {uri} ..."):
                    reply = remote.push_source(name, uri, version, options)
            else:
                reply = remote.push(name, path, version, options)
        record = reply["version"]
        console.print(
            f"registered [bold]{name}:{version}[/bold] ({record['framework']}) on {url}, "
            f"sha256 {record['sha256'][:12]}"
        )
        if not reply["serving"]:
            console.print(
                f"it takes no traffic yet: 'POST /api/v1/deployments' (or inferd deploy on the "
                f"server) with {version} gives it some"
            )
        print(json.dumps(record, indent=2))
        return
    from inferd.registry import Registry
    from inferd.runtimes import inspect_artifact, prepare_artifact

    settings = _settings(config, data_dir=data_dir)
    registry = Registry.from_settings(settings)
    with (
        _errors(),
        _source_folder(uri, path, settings) as (folder, imported),
        tempfile.TemporaryDirectory(prefix="inferd-push-") as scratch,
    ):
        inputs = None
        if imported is not None:  # an MLflow model, converted
            framework = framework or imported.framework
            metadata = {**imported.metadata, **metadata}
            declared = declared or imported.signature
            description = description or imported.description
            inputs = imported.inputs
        with console.status(f"loading {source} to check it and read its signature ..."):
            try:
                folder, framework, made = prepare_artifact(folder, framework, Path(scratch))
                metadata = {**made, **metadata}
                found, sig = inspect_artifact(folder, framework, metadata, declared, inputs)
            except Exception as exc:  # any loader error: say what failed, no traceback
                console.print(
                    f"[red]error:[/red] cannot load {source}: {type(exc).__name__}: {exc}"
                )
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
            deploy=deploy,
        )
        serving = [v.version for v in registry.get_model(name).versions if v.version != version]
    console.print(
        f"registered [bold]{name}:{version}[/bold] ({found}), sha256 {record.sha256[:12]}"
    )
    if serving and not deploy:
        console.print(
            f"it takes no traffic yet: 'inferd deploy {name} {version} --traffic 10' gives it "
            "10 %, --deploy on a push gives it all"
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
    console.print(f"it takes no traffic yet: 'inferd deploy {name} {new_version}' serves it")
    print(json.dumps(new.to_dict(), indent=2))


@contextmanager
def _source_folder(uri: str | None, path: Path, settings: Any) -> Any:
    """The folder to push, and for an MLflow URI what its import made of it."""
    limit = settings.registry.max_upload_bytes
    if uri is None:
        with _as_folder(path) as folder:
            yield folder, None
        return
    with tempfile.TemporaryDirectory(prefix="inferd-push-") as tmp:
        if uri.startswith("s3://"):
            from inferd.registry.remote_store import fetch_source

            with console.status(f"fetching {uri} ..."):
                yield fetch_source(uri, Path(tmp) / "imported", limit), None
            return
        from inferd.registry.mlflow_source import import_model

        with console.status(f"importing {uri} from MLflow ..."):
            imported = import_model(uri, settings.registry.mlflow_tracking_uri, Path(tmp), limit)
        yield imported.folder, imported


def _is_uri(source: str) -> bool:
    from inferd.registry.mlflow_source import is_mlflow_uri

    return source.startswith("s3://") or is_mlflow_uri(source)


@contextmanager
def _as_folder(path: Path) -> Any:
    if path.is_dir():
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="inferd-push-") as tmp:
        shutil.copy2(path, Path(tmp) / path.name)
        yield Path(tmp)


@models_app.command("list")
def models_list(
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Registered models and their versions (of a running server with --url)."""
    table = Table("model", "framework", "versions", "latest", "description")
    if url:
        with _remote(url, api_key) as remote:
            models = remote.get("/api/v1/models")["models"]
        rows = [
            (m["name"], m.get("framework"), list(m["versions"]),
             m.get("description"))
            for m in models
        ]  # fmt: skip
    else:
        rows = [
            (m.name, m.framework, [v.version for v in m.versions], m.description)
            for m in _registry(config, data_dir).list_models()
        ]
    for model, framework, versions, description in rows:
        latest = versions[-1] if versions else "-"
        table.add_row(model, framework or "-", ", ".join(versions), latest, description or "")
    Console().print(table)


@models_app.command("show")
def models_show(
    name: str,
    version: Annotated[str | None, typer.Option("--version", "-v")] = None,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """One model (or one version) as JSON: signature, metadata, checksum."""
    if url:
        path = f"/api/v1/models/{name}" + (f"/versions/{version}" if version else "")
        with _remote(url, api_key) as remote:
            print(json.dumps(remote.get(path), indent=2))
        return
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


@models_app.command("pull")
def models_pull(
    name: Annotated[str, typer.Argument(help="Model name.")],
    version: Annotated[str, typer.Argument(help="The version to fetch.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="A new folder for its files.")],
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Fetch a version's files (with its inferd.json) into a new folder, checked against
    the registry's digest: 'inferd models push' of that folder answers the same."""
    if url:
        with _remote(url, api_key) as remote:
            digest = remote.pull(name, version, out)
    else:
        from inferd.registry.store import digest_of

        registry = _registry(config, data_dir)
        with _errors():
            record = registry.get_version(name, version)
        if out.exists() and any(out.iterdir()):
            console.print(f"[red]error:[/red] {out} exists and is not empty")
            raise typer.Exit(1)
        from inferd.registry.registry import local_files

        if registry.remote is None and not registry.store.verify(name, version):
            console.print(f"[red]error:[/red] the stored files of {name}:{version} are damaged")
            raise typer.Exit(1)
        with _errors():
            files = local_files(registry, record)  # from the store, checked, when it is S3
        shutil.copytree(files, out, dirs_exist_ok=True)
        digest = digest_of(out)
    console.print(f"pulled [bold]{name}:{version}[/bold] into {out}, sha256 {digest[:12]}")


@models_app.command("prefetch")
def models_prefetch(
    name: Annotated[str, typer.Argument(help="Model name.")],
    version: Annotated[str, typer.Argument(help="The version to fetch.")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Put a version of the S3 artifact store in this host's artifact cache (checked
    against the registry's digest), so its replicas here start without a download: run
    it on a host (or a node, with kubernetes.node_cache_path) before a deploy."""
    from inferd.registry.registry import local_files

    registry = _registry(config, data_dir)
    with _errors():
        record = registry.get_version(name, version)
        if registry.remote is None or record.artifact_uri.startswith("file:"):
            console.print(f"{name}:{version} is in the local store: nothing to fetch")
            return
        began = time.monotonic()
        folder = local_files(registry, record)
    console.print(
        f"[bold]{name}:{version}[/bold] is in this host's cache ({folder}), "
        f"{time.monotonic() - began:.1f}s"
    )


@contextmanager
def _remote(url: str, api_key: str | None) -> Any:
    """A client of the server at ``url``; a network failure is a one-line error."""
    import httpx

    from inferd.cli.remote import RemoteRegistry

    try:
        with RemoteRegistry(url, api_key) as remote:
            yield remote
    except httpx.HTTPError as exc:
        console.print(f"[red]error:[/red] {url}: {type(exc).__name__}: {exc}")
        raise typer.Exit(1) from None


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
