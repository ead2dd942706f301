"""``inferd replica``: one replica on any host that joins a controller.

It dials the controller's control channel (``cluster.control``, proven with the cluster
token and/or mutual TLS), asks to serve ``model:version`` at its advertised address
(:class:`~inferd.shapes.control.Join`), gets its spec back
(:class:`~inferd.shapes.control.Joined`), fetches the version's files from the S3
artifact store into its own data folder (checked against the registered digest), loads
them and serves on ``--listen`` like any replica, beating its state to the controller
every second. The controller routes gateways to it once it beats ``ready``.

Losing the controller does not stop it: it keeps serving the gateways that know it, and
joins again (same replica id) when a controller answers, a restarted one or the one
that took over. The controller's drain (scale-down, undeploy) and SIGTERM make it
finish what it accepted and leave with code 0; a refusal (the version is not deployed
there) or files it cannot have here leave with code 2 and the reason.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from pathlib import Path
from typing import Any

import msgspec

from inferd import transport
from inferd.shapes.control import (
    Beat,
    DrainReplica,
    Join,
    Joined,
    Refused,
    decode_table,
    encode_request,
)
from inferd.shapes.replica import ReplicaState
from inferd.shapes.replica_spec import ReplicaSpec

logger = logging.getLogger(__name__)
BEAT_S = 1.0
REFUSED = 2


class JoinRefused(Exception):
    pass


class ControlLink:
    """The replica's connection to the controller: join, beats up, a drain down."""

    def __init__(self, control: str, join: Join, on_drain: Any) -> None:
        self.control = control
        self.request = join
        self.on_drain = on_drain
        self.replica_id = ""
        self.state = ReplicaState.LOADING
        self.message = ""
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._beats: asyncio.Task[None] | None = None

    async def join(self) -> ReplicaSpec:
        """The first join: wait for a controller, then its answer."""
        spec = await self._dial()
        loop = asyncio.get_running_loop()
        self._beats = loop.create_task(self._beat_forever())
        return spec

    async def _dial(self) -> ReplicaSpec:
        backoff = 0.2
        while True:
            try:
                reader, writer, _ = await transport.open_any(self.control, timeout_s=3.0)
            except transport.AuthError as exc:
                logger.error("the controller at %s refused this replica: %s", self.control, exc)
                await asyncio.sleep(1.0)
                continue
            except (OSError, TimeoutError) as exc:
                logger.debug("controller at %s not reachable: %s", self.control, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            request = msgspec.structs.replace(self.request, replica_id=self.replica_id)
            writer.write(encode_request(request))
            try:
                answer = await asyncio.wait_for(self._answer(reader), 10.0)
            except (asyncio.IncompleteReadError, ConnectionError, OSError, TimeoutError) as exc:
                # With TLS the listener checks our certificate after the handshake: a
                # refusal shows as the connection closing here.
                logger.error(
                    "the controller at %s closed the connection before answering the join "
                    "(is this host's certificate signed by the cluster's CA?): %r",
                    self.control, exc,
                )  # fmt: skip
                writer.close()
                await asyncio.sleep(1.0)
                continue
            if isinstance(answer, Refused):
                writer.close()
                raise JoinRefused(answer.reason)
            self.replica_id = answer.replica_id
            self._writer = writer
            writer.write(encode_request(Beat(self.state, self.message)))
            self._task = asyncio.get_running_loop().create_task(self._follow(reader))
            return ReplicaSpec.from_json(answer.spec)

    @staticmethod
    async def _answer(reader: asyncio.StreamReader) -> Joined | Refused:
        while True:  # a routing table may come first: not for us
            size = int.from_bytes(await reader.readexactly(4), "little")
            message = decode_table(await reader.readexactly(size))
            if isinstance(message, Joined | Refused):
                return message

    async def _follow(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(4), "little")
                if isinstance(decode_table(await reader.readexactly(size)), DrainReplica):
                    logger.info("the controller drains this replica")
                    self.on_drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        self._writer = None
        logger.warning(
            "lost the controller at %s; serving on, joining again when it answers", self.control
        )
        try:
            await self._dial()
            logger.info("joined %s again as %s", self.control, self.replica_id)
        except JoinRefused as exc:
            logger.error("the controller no longer takes this replica: %s; draining", exc)
            self.on_drain()

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(BEAT_S)
            self.beat()

    def beat(self) -> None:
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.write(encode_request(Beat(self.state, self.message)))

    def close(self) -> None:
        for task in (self._task, self._beats):
            if task is not None:
                task.cancel()
        if self._writer is not None:
            self._writer.close()


def localize(spec: ReplicaSpec, cache_dir: Path, cache_max_bytes: int) -> ReplicaSpec:
    """The spec with this host's folder for the version's files: its entry in this
    host's artifact cache (``cache_dir``) when they come from an S3 store; the
    controller's own folder only when this host has it (a shared mount); ValueError
    otherwise."""
    if spec.artifact_uri.startswith("s3://"):
        cache = cache_dir.resolve()
        return msgspec.structs.replace(
            spec,
            artifact_dir=str(cache / spec.sha256),
            artifact_cache_dir=str(cache),
            artifact_cache_max_bytes=cache_max_bytes,
        )
    if Path(spec.artifact_dir).is_dir():
        return spec
    raise ValueError(
        f"{spec.model}:{spec.version}'s files are in a local folder of the controller's "
        f"host ({spec.artifact_dir}), which this host does not have: a replica on another "
        "host needs an S3 artifact store (INFERD_ARTIFACT_STORE=s3://bucket/prefix on the "
        "controller) or that folder mounted here"
    )


async def run_joined(
    control: str,
    model: str,
    version: str,
    listen: str,
    advertise: str,
    cache: tuple[Path, int],
    grace_s: float,
) -> int:
    """Join, serve until drained or signalled; the exit code."""
    from inferd.serving.replica_server import serve

    loop = asyncio.get_running_loop()
    drain = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain.set)
    link = ControlLink(control, Join(model, version, advertise, socket.gethostname()), drain.set)
    joining = loop.create_task(link.join())
    stopped = loop.create_task(drain.wait())
    await asyncio.wait([joining, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not joining.done():  # told to stop before any controller took it
        joining.cancel()
        await asyncio.gather(joining, return_exceptions=True)
        link.close()
        return 0
    try:
        spec = localize(joining.result(), *cache)
    except (JoinRefused, ValueError) as exc:
        logger.error("cannot serve %s:%s here: %s", model, version, exc)
        link.close()
        return REFUSED
    logger.info("joined %s as %s; serving at %s", control, spec.replica_id, advertise)
    cores: list[Any] = []

    async def report() -> None:
        while True:
            await asyncio.sleep(0.1)
            if cores and (cores[0].state, cores[0].message) != (link.state, link.message):
                link.state, link.message = cores[0].state, cores[0].message
                link.beat()  # at once: the controller routes to it on "ready"

    reporter = loop.create_task(report())
    try:
        here = msgspec.structs.replace(spec, address=f"tcp:{listen}")
        return await serve(here, drain, grace_s, on_core=cores.append)
    finally:
        reporter.cancel()
        link.state = ReplicaState.STOPPED
        link.beat()
        link.close()
