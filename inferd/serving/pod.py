"""``inferd replica --spec-env``: a replica handed its spec, as a Kubernetes pod is.

The Kubernetes backend (:mod:`inferd.control.backends.kubernetes`) writes the version's
:class:`~inferd.serving.spec.ReplicaSpec` into the pod template's environment; every pod
of the version serves it under its own name (``--replica-id``) as replica id. It
fetches the version's files from the S3 artifact store into its data folder (checked
against the registered digest), serves the replica protocol on ``listen`` behind the
cluster's credentials, and answers the kubelet's probes on ``health``
(:mod:`inferd.serving.health`). Nothing dials the controller: the controller finds the
pod through the Kubernetes API once its readiness probe passes.

SIGTERM (Kubernetes deleting the pod: a scale-down, an undeploy, a rolling update) fails
the readiness probe at once and drains what was accepted within ``grace_s``; the pod's
``terminationGracePeriodSeconds`` is set above it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

import msgspec

from inferd.serving.joiner import REFUSED, localize
from inferd.serving.spec import ReplicaSpec

logger = logging.getLogger(__name__)


def spec_of(text: str) -> ReplicaSpec:
    """The spec from its JSON (ValueError naming what is wrong)."""
    try:
        return ReplicaSpec.from_json(text)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a replica spec: {exc}") from None


async def run_pod(
    spec: ReplicaSpec,
    replica_id: str,
    listen: str,
    health: str,
    cache: tuple[Path, int],
    grace_s: float,
) -> int:
    """Serve ``spec`` until SIGTERM; the exit code."""
    from inferd.serving.health import serve_health
    from inferd.serving.replica_server import serve

    loop = asyncio.get_running_loop()
    drain = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain.set)
    try:
        spec = localize(spec, *cache)
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
