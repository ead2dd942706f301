"""``inferd replica --spec-env``: a replica handed its spec, as a Kubernetes pod is.

The Kubernetes backend (:mod:`inferd.control.backends.kubernetes`) writes the version's
:class:`~inferd.shapes.replica_spec.ReplicaSpec` into the pod template's environment; every pod
of the version serves it under its own name (``--replica-id``) as replica id. It
fetches the version's files from the S3 artifact store into its data folder (checked
against the registered digest), serves the replica protocol on ``listen`` behind the
cluster's credentials, and answers the kubelet's probes on ``health``
(:mod:`inferd.serving.health`). Nothing dials the controller: the controller finds the
pod through the Kubernetes API once its readiness probe passes.

SIGTERM (Kubernetes deleting the pod: a scale-down, an undeploy, a rolling update) fails
the readiness probe at once and drains what was accepted within ``grace_s``; the pod's
``terminationGracePeriodSeconds`` is set above it.

With its node's artifact cache (``kubernetes.node_cache_path``) a pod runs in two steps,
because the replica runs its version's code and the cache holds every version of the
node: its init container, from the chart's image, runs :func:`fetch_only` (``inferd
replica --spec-env … --fetch-only``), the one writer of the node's cache, which fetches
the version's entry or hashes the cached one again; then the replica container, which
mounts that cache read-only, serves from the entry without writing
(``--read-only-cache``: :func:`from_node`), or, when the entry has gone since (a
container restart after an eviction), fetches into the pod's own folder.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from inferd.serving.joiner import REFUSED, localize
from inferd.shapes.replica_spec import ReplicaSpec

if TYPE_CHECKING:
    from inferd.registry.artifact_cache import ArtifactCache

logger = logging.getLogger(__name__)


def spec_of(text: str) -> ReplicaSpec:
    """The spec from its JSON (ValueError naming what is wrong)."""
    try:
        return ReplicaSpec.from_json(text)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a replica spec: {exc}") from None


def fetch_only(spec: ReplicaSpec, cache: tuple[Path, int]) -> int:
    """The pod's fetch step: the version's files into the artifact cache ``cache``
    (the node's), downloaded and checked, or, cached, hashed again (fetched anew when
    they changed since); the exit code. Loads nothing: no version's code runs here."""
    from inferd.serving.replica_server import fetch_artifact

    try:
        spec = localize(spec, *cache)
    except ValueError as exc:
        logger.error("cannot fetch %s:%s here: %s", spec.model, spec.version, exc)
        return REFUSED
    if not spec.artifact_uri.startswith("s3://"):
        return 0  # its files are a folder this host has: nothing to fetch
    try:
        opened = fetch_artifact(spec, hold=False, verify=True)
    except Exception as exc:
        logger.error("fetching %s failed: %s", spec.artifact_uri, exc)
        return 1
    logger.info(
        "%s in %s (%s)", spec.artifact_uri, opened.path,
        f"fetched {opened.fetched_bytes} bytes" if opened.fetched_bytes else "cached, checked",
    )  # fmt: skip
    return 0


def from_node(spec: ReplicaSpec, own: tuple[Path, int]) -> tuple[ReplicaSpec, ArtifactCache | None]:
    """``spec`` (localized to the node's read-only cache) served from the node's entry,
    which the pod's fetch step checked, held from eviction by the cache returned
    (nothing left to fetch: ``artifact_uri`` empty); or, when the node has no entry now,
    localized to the pod's own cache ``own`` instead (fetched there) and None."""
    from inferd.registry.artifact_cache import ArtifactCache

    if not spec.artifact_uri.startswith("s3://"):
        return spec, None
    node = ArtifactCache(Path(spec.artifact_cache_dir), spec.artifact_cache_max_bytes)
    try:
        node.use(spec.sha256)
    except OSError as exc:  # gone (evicted since the fetch step), or unreadable
        logger.warning("%s; fetching %s into the pod's own folder", exc, spec.artifact_uri)
        return localize(spec, *own), None
    return msgspec.structs.replace(spec, artifact_uri=""), node


async def run_pod(
    spec: ReplicaSpec,
    replica_id: str,
    listen: str,
    health: str,
    cache: tuple[Path, int],
    grace_s: float,
    own_cache: tuple[Path, int] | None = None,
) -> int:
    """Serve ``spec`` until SIGTERM; the exit code. ``own_cache``: ``cache`` is the
    node's, read-only here, and this the pod's own (see :func:`from_node`)."""
    from inferd.serving.health import serve_health
    from inferd.serving.replica_server import serve

    loop = asyncio.get_running_loop()
    drain = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain.set)
    node = None
    try:
        spec = localize(spec, *cache)
        if own_cache is not None:
            spec, node = from_node(spec, own_cache)
    except ValueError as exc:
        logger.error("cannot serve %s:%s here: %s", spec.model, spec.version, exc)
        return REFUSED
    here = msgspec.structs.replace(spec, replica_id=replica_id, address=f"tcp:{listen}")
    cores: list[Any] = []

    def state() -> tuple[str, str]:
        if drain.is_set():
            return "draining", "stopping"
        if not cores:
            return "loading", ""
        return cores[0].state, cores[0].message

    health_server = await serve_health(health, state)
    logger.info("serving %s:%s as %s on %s", spec.model, spec.version, here.replica_id, listen)
    try:
        return await serve(here, drain, grace_s, on_core=cores.append)
    finally:
        health_server.close()
        if node is not None:
            node.close()
