"""Registering over the API (admin scope when auth is on): create and edit models,
register a version from an upload or a ``source_uri``, download a version's artifact,
delete a version.

``POST /api/v1/models/{model}/versions`` takes either

- a JSON body ``{"version", "source_uri", ...}``: the server imports the source
  (``file://`` inside ``registry.import_roots``, ``s3://``, or an MLflow
  ``models:/``/``runs:/`` URI, fetched and converted in the check's child process by
  :mod:`inferd.registry.mlflow_source`); or
- the artifact itself as the body (a tar, tar.gz or zip of the artifact folder, or one
  file with ``filename``), with the options in the query string (``version``,
  ``sha256``, ``filename``, ``framework``, ``deploy``, ``description``, ``owner``, and
  ``signature``, ``metadata``, ``batching`` as JSON text). The body streams to a file
  under ``<data_dir>/uploads`` while its size is counted and its sha256 computed.

Either way the new version is checked in a child process (loaded, warmed up, its
signature read), then registered as ``inferd models push`` registers it: registering is
not deploying unless ``deploy`` is true (see :meth:`inferd.registry.Registry.push`).
"""

from __future__ import annotations

import asyncio
import shutil
import tarfile
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect
from starlette.responses import FileResponse, Response

from inferd.api.http import context_of, json_response, parse_json, read_json
from inferd.api.state import gateway_of
from inferd.errors import (
    BadRequest,
    InvalidInput,
    PayloadTooLarge,
)
from inferd.registry.inspection import inspect_isolated
from inferd.registry.mlflow_source import is_mlflow_uri
from inferd.registry.store import check_name
from inferd.registry.uploads import SHA256_HEX, UPLOADS, check_sha256, file_source, receive, unpack
from inferd.shapes.tensors import Signature

if TYPE_CHECKING:
    from inferd.registry import Registry

router = APIRouter(prefix="/api/v1/models", tags=["registry"])

_PUSH_FIELDS = frozenset(
    {
        "version", "source_uri", "framework", "signature", "metadata", "batching",
        "description", "owner", "deploy", "sha256", "filename",
    }
)  # fmt: skip
_MODEL_FIELDS = frozenset({"name", "description", "owner", "framework", "tags"})


def _registry(request: Request) -> Registry:
    registry: Registry = gateway_of(request).registry
    return registry


def _actor(request: Request) -> str:
    principal = context_of(request.scope).principal
    who = principal.subject if principal is not None else None
    return str(request.headers.get("x-inferd-actor") or who or "api")[:128]


@router.post("", status_code=201)
async def create_model(request: Request) -> Response:
    """A model with no version yet: ``{"name", "framework", "description", "owner",
    "tags"}``. Its first version serves at once when it is pushed."""
    body = _object(await read_json(request, gateway_of(request).settings.max_body_bytes))
    _only(body, _MODEL_FIELDS, "model")
    name = body.get("name")
    if not isinstance(name, str):
        raise InvalidInput("name is required: the model's name")
    record = await asyncio.to_thread(
        _registry(request).create_model,
        name,
        framework=body.get("framework") or "unknown",
        description=body.get("description"),
        owner=body.get("owner"),
        tags=body.get("tags"),
    )
    return json_response(record.to_dict(), status_code=201)


@router.patch("/{model}")
async def update_model(model: str, request: Request) -> Response:
    """Change a model's description, owner, framework or tags (the fields given)."""
    body = _object(await read_json(request, gateway_of(request).settings.max_body_bytes))
    _only(body, _MODEL_FIELDS - {"name"}, "model")
    record = await asyncio.to_thread(_registry(request).update_model, model, **body)
    return json_response(record.to_dict())


@router.post("/{model}/versions", status_code=201)
async def push_version(model: str, request: Request) -> Response:
    """Register a version from an upload (the body) or a ``source_uri`` (JSON body)."""
    check_name("model", model)
    settings = gateway_of(request).settings
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/json":
        spec = _object(await read_json(request, settings.max_body_bytes))
        _only(spec, _PUSH_FIELDS - {"sha256", "filename"}, "push")
    else:
        spec = _query_spec(request)
    version = spec.get("version")
    if not isinstance(version, str):
        raise InvalidInput("version is required: the new version's label, e.g. v3.1")
    check_name("version", version)
    registry = _registry(request)
    await asyncio.to_thread(registry.refuse_existing, model, version)  # 409 before the body
    options = _push_options(spec)
    scratch = Path(settings.data_dir) / UPLOADS / uuid.uuid4().hex
    scratch.mkdir(parents=True)
    try:
        mlflow = None
        if content_type == "application/json":
            source_uri = spec.get("source_uri")
            if not isinstance(source_uri, str):
                raise InvalidInput(
                    "source_uri is required with a JSON body (or upload the artifact as the body)"
                )
            if is_mlflow_uri(source_uri):  # fetched and converted by the check's child
                source = scratch
                mlflow = {
                    "uri": source_uri,
                    "tracking_uri": settings.registry.mlflow_tracking_uri,
                    "limit_bytes": settings.registry.max_upload_bytes,
                }
            else:
                source = await asyncio.to_thread(_import, source_uri, settings, scratch)
        else:
            source = await _upload(request, spec, scratch, settings.registry.max_upload_bytes)
        checked = await inspect_isolated(
            source,
            options["framework"],
            options["metadata"],
            options["signature"],
            settings.registry.inspect_timeout_s,
            mlflow,
            scratch,
        )
        record = await asyncio.to_thread(
            registry.push,
            model,
            checked.folder,
            version,
            framework=checked.framework,
            signature=checked.signature,
            metadata={**checked.metadata, **options["metadata"]},
            description=options["description"] or checked.description,
            owner=options["owner"],
            batching=options["batching"],
            deploy=options["deploy"],
            actor=_actor(request),
        )
    finally:
        await asyncio.to_thread(shutil.rmtree, scratch, True)
    await gateway_of(request).router.server.request_reconcile(model)
    found = await asyncio.to_thread(registry.get_model, model)
    others = [v.version for v in found.versions if v.version != version]
    deployments = await asyncio.to_thread(registry.deployments.list_all, model)
    serves = (
        (options["deploy"] or not others)
        if not deployments
        else any(d.version == version and d.traffic_pct > 0 for d in deployments)
    )
    return json_response({"version": record.to_dict(), "serving": serves}, status_code=201)


@router.get("/{model}/versions/{version}/artifact")
async def download_artifact(model: str, version: str, request: Request) -> Response:
    """The version's artifact folder as a tar.gz; ``X-Inferd-Sha256`` is the version's
    digest (of its files, as the registry lists them), which ``inferd models pull``
    checks after unpacking."""
    from inferd.registry.registry import local_files  # the database layer: read below anyway

    registry = _registry(request)
    record = await asyncio.to_thread(registry.get_version, model, version)
    scratch = Path(gateway_of(request).settings.data_dir) / UPLOADS
    scratch.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="pull-", suffix=".tar.gz", dir=scratch)
    archive = Path(name)

    def pack() -> None:
        root = local_files(registry, record)  # fetched and checked, from an object store
        with open(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz", compresslevel=1) as tar:
            for path in sorted(root.rglob("*")):
                tar.add(path, arcname=path.relative_to(root).as_posix(), recursive=False)

    try:
        await asyncio.to_thread(pack)
    except BaseException:
        archive.unlink(missing_ok=True)
        raise
    return FileResponse(
        archive,
        media_type="application/gzip",
        filename=f"{model}-{version}.tar.gz",
        headers={"x-inferd-sha256": record.sha256},
        background=BackgroundTask(archive.unlink, missing_ok=True),
    )


@router.delete("/{model}/versions/{version}")
async def delete_version(model: str, version: str, request: Request) -> Response:
    """Remove a version and its files (409 while it is deployed or serving)."""
    await asyncio.to_thread(_registry(request).delete_version, model, version)
    await gateway_of(request).router.server.request_reconcile(model)
    return json_response({"deleted": {"model": model, "version": version}})


# -- helpers ----------------------------------------------------------------------------


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _only(body: dict[str, Any], known: frozenset[str], what: str) -> None:
    unknown = set(body) - known
    if unknown:
        raise InvalidInput(f"unknown {what} fields {sorted(unknown)}; known: {sorted(known)}")


def _query_spec(request: Request) -> dict[str, Any]:
    """The options of an upload, from its query string (JSON ones parsed)."""
    spec: dict[str, Any] = {}
    for key, value in request.query_params.items():
        if key not in _PUSH_FIELDS or key == "source_uri":
            known = sorted(_PUSH_FIELDS - {"source_uri"})
            raise InvalidInput(f"unknown upload parameter {key!r}; known: {known}")
        if key in ("signature", "metadata", "batching"):
            try:
                spec[key] = parse_json(value.encode())
            except BadRequest:
                raise InvalidInput(f"{key} must be JSON text") from None
        elif key == "deploy":
            if value.lower() not in ("true", "false", "1", "0"):
                raise InvalidInput(f"deploy must be true or false, not {value!r}")
            spec[key] = value.lower() in ("true", "1")
        else:
            spec[key] = value
    sha = spec.get("sha256")
    if sha is not None and not SHA256_HEX.match(sha.lower()):
        raise InvalidInput("sha256 must be 64 hex digits: the upload's sha256")
    return spec


def _push_options(spec: dict[str, Any]) -> dict[str, Any]:
    metadata = spec.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidInput("metadata must be a JSON object")
    batching = spec.get("batching")
    if batching is not None and not isinstance(batching, dict):
        raise InvalidInput("batching must be a JSON object")
    declared = spec.get("signature")
    try:
        signature = Signature.from_dict(declared) if declared is not None else None
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidInput(f"invalid signature: {exc}") from None
    deploy = spec.get("deploy", False)
    if not isinstance(deploy, bool):
        raise InvalidInput(f"deploy must be true or false, not {deploy!r}")
    for key in ("framework", "description", "owner"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise InvalidInput(f"{key} must be a string")
    return {
        "metadata": metadata,
        "batching": batching,
        "signature": signature,
        "deploy": deploy,
        "framework": spec.get("framework"),
        "description": spec.get("description"),
        "owner": spec.get("owner"),
    }


def _import(source_uri: str, settings: Any, scratch: Path) -> Path:
    scheme = source_uri.split(":", 1)[0].lower() if ":" in source_uri else ""
    if scheme == "file":
        return file_source(source_uri, list(settings.registry.import_roots))
    if scheme == "s3":
        from inferd.registry.remote_store import fetch_source

        return fetch_source(source_uri, scratch / "imported", settings.registry.max_upload_bytes)
    raise InvalidInput(
        f"source_uri {source_uri!r}: unknown scheme {scheme!r}; supported: file:// "
        "(inside registry.import_roots), s3://bucket/key (a folder or one object), "
        "models:/name/version and runs:/run_id/path (MLflow)"
    )


async def _upload(request: Request, spec: dict[str, Any], scratch: Path, limit: int) -> Path:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(
            f"the upload of {length} bytes exceeds registry.max_upload_bytes ({limit})",
            limit_bytes=limit,
        )
    try:
        received = await receive(request.stream(), scratch / "upload", limit)
    except ClientDisconnect:
        raise BadRequest(
            "the client went away before the upload ended; nothing was registered"
        ) from None
    if received.size_bytes == 0:
        raise InvalidInput("the upload is empty: send the artifact as the request body")
    check_sha256(received, spec.get("sha256"))
    return await asyncio.to_thread(
        unpack, received.path, scratch / "unpacked", spec.get("filename"), limit
    )
