"""The replica process (``python -m inferd.serving.replica_server SPEC GRACE``, see
:func:`main`) and its socket server: frames in, calls on its core
(:class:`~inferd.serving.core.Core`), frames out.

One asyncio Protocol per gateway connection. Infer requests do not get a task each:
a done-callback on the batcher's future writes the reply, which keeps the per-request
cost of the replica to decoding, one future and encoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from inferd import transport
from inferd.errors import InvalidInput
from inferd.process import die_with_parent
from inferd.serving import inprocess
from inferd.serving.batcher import BatchTrace
from inferd.serving.core import Core, EngineLoad
from inferd.serving.replica import ReplicaCore, error_status
from inferd.shapes import replica as p
from inferd.shapes.replica import Columns, ReplicaState
from inferd.shapes.replica_spec import ReplicaSpec
from inferd.telemetry import tracing
from inferd.telemetry.logging import request_id_var

if TYPE_CHECKING:
    from inferd.registry.artifact_cache import Opened
    from inferd.runtimes.explain import Explanation
    from inferd.shapes.llm import TokenOutput

logger = logging.getLogger(__name__)


LOAD_EVERY_S = 0.02
"""How often a generation replica reads its engine's state, and sends it to every
connected gateway when it changed (:class:`~inferd.shapes.replica.Load`)."""
LOAD_AT_LEAST_S = 1.0
"""...and at least this often, unchanged: a gateway that connected since hears it."""


class Gateways:
    """The gateways connected to this replica, and the prompt keys they sent it since
    the last ``Load`` frame (every gateway learns where any gateway sent a prefix:
    :mod:`inferd.routing.prefix`)."""

    MAX_KEYS = 8192
    """Keys kept for the next frame at most (beyond, the oldest are not reported)."""

    def __init__(self) -> None:
        self.connections: set[ReplicaProtocol] = set()
        self.prefix: list[int] = []

    def sent(self, keys: list[int]) -> None:
        self.prefix += keys
        if len(self.prefix) > self.MAX_KEYS:
            del self.prefix[: -self.MAX_KEYS]


class ReplicaProtocol(asyncio.Protocol):
    def __init__(
        self,
        core: Core,
        on_drain: asyncio.Event,
        gateways: Gateways,
        fetched: dict[str, float] | None = None,
    ) -> None:
        self.core = core
        self.fetched = fetched if fetched is not None else {}
        """How the version's files came (``fetch_s``, ``fetched_bytes``), for its stats."""
        self.on_drain = on_drain
        self.gateways = gateways
        self.connections = gateways.connections
        self.frames = p.FrameBuffer()
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[Columns]] = {}
        self.generations: dict[int, str] = {}  # frame id -> engine request id
        self.spans: dict[int, tracing.GenerationSpan] = {}  # traced generations, by frame id
        self.writer: p.TurnWriter | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.writer = p.TurnWriter(transport)
        self.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()
        for rid in self.generations.values():
            self.core.cancel(rid)  # the gateway is gone: free the sequences' blocks now
        self.generations.clear()
        for span in self.spans.values():
            span.cancelled()
        self.spans.clear()
        self.transport = self.writer = None

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.frames.feed(data)
        except Exception:
            logger.exception("bad frame from gateway; closing the connection")
            if self.transport is not None:
                self.transport.close()
            return
        for message in messages:
            if isinstance(message, p.Infer):
                self._infer(message)
            elif isinstance(message, p.Generate):
                self._generate(message)
            elif isinstance(message, p.Explain):
                self._explain(message)
            elif isinstance(message, p.Cancel):
                self._cancel(message.id)
            elif isinstance(message, p.Adapter):
                self._adapter(message)
            elif isinstance(message, p.StatusQuery):
                self._send(self._status(message.id))
            elif isinstance(message, p.DriftQuery):
                self._drift(message)
            elif isinstance(message, p.Drain):
                self.on_drain.set()
                self._send(self._status(message.id))

    def _cancel(self, frame_id: int) -> None:
        future = self.pending.pop(frame_id, None)
        if future is not None:
            future.cancel()
        rid = self.generations.pop(frame_id, None)
        if rid is not None:
            self.core.cancel(rid)
            if (span := self.spans.pop(frame_id, None)) is not None:
                span.cancelled()

    def _status(self, request_id: int) -> p.Status:
        core = self.core
        stats = core.stats()
        if self.fetched:
            stats = msgspec.structs.replace(stats, **self.fetched)
        return p.Status(
            request_id,
            core.state,
            os.getpid(),
            core.spec.model,
            core.spec.version,
            stats,
            core.message,
            core.metrics(),
        )

    def _infer(self, message: p.Infer) -> None:
        trace = BatchTrace(time.time_ns())  # its timing goes back with the answer
        try:
            inputs = {name: p.from_tensor(t) for name, t in message.inputs.items()}
            future = self.core.submit(
                inputs, message.rows, message.timeout_ms / 1000, message.priority, trace
            )
        except Exception as exc:
            self._send(p.Error(message.id, *error_status(exc)))
            if message.trace is not None and tracing.tracer is not None:
                self._traced(message, trace, exc)
            return
        self.pending[message.id] = future
        future.add_done_callback(functools.partial(self._reply, message.id, message, trace))

    def _explain(self, message: p.Explain) -> None:
        started = time.perf_counter()
        try:
            inputs = {name: p.from_tensor(t) for name, t in message.inputs.items()}
            future = self.core.explain(inputs, message.rows, message.timeout_ms / 1000)
        except Exception as exc:
            self._send(p.Error(message.id, *error_status(exc)))
            return
        self.pending[message.id] = future

        def reply(future: asyncio.Future[Explanation]) -> None:
            if self.pending.pop(message.id, None) is None or future.cancelled():
                return
            if (exc := future.exception()) is not None:
                if not isinstance(exc, Exception) or error_status(exc)[2] >= 500:
                    logger.error("explain failed", exc_info=exc)
                self._send(p.Error(message.id, *error_status(exc)))
                return
            e = future.result()
            self._send(p.Explained(
                message.id, p.to_tensor(e.attributions), p.to_tensor(e.values),
                p.to_tensor(e.expected), list(e.features), list(e.outputs), e.method,
                e.space, (time.perf_counter() - started) * 1000,
            ))  # fmt: skip

        future.add_done_callback(reply)

    def _reply(
        self,
        request_id: int,
        message: p.Infer,
        trace: BatchTrace,
        future: asyncio.Future[Columns],
    ) -> None:
        self.pending.pop(request_id, None)
        if message.trace is not None and tracing.tracer is not None:
            cancelled = future.cancelled()
            self._traced(message, trace, None if cancelled else future.exception(), cancelled)
        if future.cancelled():
            return
        exc = future.exception()
        if message.reference is not None:
            self.core.shadow_outcome(future.result() if exc is None else None, message)
        if exc is not None:
            if not isinstance(exc, Exception) or error_status(exc)[2] >= 500:
                token = request_id_var.set(message.request_id or "-")  # the log line's request
                logger.error("predict failed", exc_info=exc)
                request_id_var.reset(token)
            self._send(p.Error(request_id, *error_status(exc)))
            return
        if message.reference is not None:
            self._send(p.InferResult(request_id, {}))  # a shadow's answer goes nowhere
            return
        try:
            outputs = {n: p.to_tensor(a) for n, a in future.result().items()}
        except Exception as err:
            logger.exception("encoding outputs failed")
            self._send(p.Error(request_id, *error_status(err)))
            return
        started = trace.started_ns
        self._send(p.InferResult(
            request_id, outputs, (started - trace.arrived_ns) / 1e6,
            (trace.ended_ns - started) / 1e6, trace.rows,
        ))  # fmt: skip

    def _traced(
        self,
        message: p.Infer,
        trace: BatchTrace,
        error: BaseException | None,
        cancelled: bool = False,
    ) -> None:
        assert message.trace is not None
        tracing.record_replica_infer(
            message.trace, trace.arrived_ns, trace, message.request_id,
            self.core.spec.framework, None if error is None else error_status(error)[:3],
            cancelled,
        )  # fmt: skip

    def _generate(self, message: p.Generate) -> None:
        rid = f"{id(self):x}-{message.id}"
        if message.prefix:
            self.gateways.sent(message.prefix)

        def send(out: TokenOutput | BaseException) -> None:
            if isinstance(out, BaseException):  # refused, or failed after it was accepted
                self.generations.pop(message.id, None)
                self._send(p.Error(message.id, *error_status(out)))
                return
            if out.finished:
                self.generations.pop(message.id, None)
            ids = out.token_ids or ([] if out.token_id is None else [out.token_id])
            logprobs = out.logprobs or (None if out.logprob is None else [out.logprob])
            self._send(p.TokenChunk(
                message.id, out.text, ids, out.finished, out.finish_reason,
                out.prompt_tokens, out.completion_tokens, logprobs, out.cached_tokens,
                out.replayed,
            ))  # fmt: skip

        sink: Callable[[Any], None] = send
        if message.trace is not None and tracing.tracer is not None:
            sink = self._traced_sink(message, send)
        try:
            arrived = None
            if message.arrived_at > 0:  # the gateway's wall clock on this replica's monotonic one
                arrived = time.monotonic() - max(0.0, time.time() - message.arrived_at)
            accepted = self.core.generate(
                rid, message.prompt, message.params, message.adapter, sink, arrived,
                message.resume,
            )  # fmt: skip
        except Exception as exc:
            sink(exc)
            return
        self.generations[message.id] = rid

        def refused(future: asyncio.Future[None]) -> None:
            if (exc := future.exception()) is not None:
                sink(exc)

        asyncio.wrap_future(accepted).add_done_callback(refused)

    def _traced_sink(
        self, message: p.Generate, sink: Callable[[Any], None]
    ) -> Callable[[Any], None]:
        """``sink`` that also keeps the generation's span (:class:`GenerationSpan`)."""
        assert message.trace is not None
        span = self.spans[message.id] = tracing.GenerationSpan(message.trace, message.request_id)

        def traced(out: TokenOutput | BaseException) -> None:
            span.update(out)
            if span.ended:
                self.spans.pop(message.id, None)
            sink(out)

        return traced

    def _drift(self, message: p.DriftQuery) -> None:
        """A predict replica's input counts (see :mod:`inferd.telemetry.drift`)."""
        try:
            if not isinstance(self.core, ReplicaCore):
                raise InvalidInput("input drift is measured for predict models only")
            self._send(self.core.drift_counts(message))
        except Exception as exc:
            self._send(p.Error(message.id, *error_status(exc)))

    def _adapter(self, message: p.Adapter) -> None:
        def done(future: asyncio.Future[dict[str, Any]]) -> None:
            exc = future.exception()
            if exc is not None:
                self._send(p.Error(message.id, *error_status(exc)))
            else:
                status = self._status(message.id)
                status.stats.adapters = len(future.result())
                self._send(status)

        try:
            asyncio.wrap_future(self.core.adapter(message.name, message.path)).add_done_callback(
                done
            )
        except Exception as exc:
            self._send(p.Error(message.id, *error_status(exc)))

    def _send(self, message: p.Message) -> None:
        """Frames of one turn of the event loop go in one write (see p.TurnWriter)."""
        writer = self.writer
        if writer is not None and not writer.transport.is_closing():
            writer.write(p.encode(message))


async def start_listening(
    core: Core,
    address: str,
    drain: asyncio.Event,
    gateways: Gateways,
    fetched: dict[str, float] | None = None,
) -> asyncio.Server | inprocess.Listener:
    loop = asyncio.get_running_loop()
    kind, _, where = address.partition(":")

    def protocol() -> ReplicaProtocol:
        return ReplicaProtocol(core, drain, gateways, fetched)

    if kind == "inproc":
        return inprocess.listen(where, protocol)
    if kind == "unix":
        Path(where).unlink(missing_ok=True)
        return await loop.create_unix_server(protocol, where)
    # another host's gateways: only peers proving the cluster's credentials get a frame in
    return await transport.listen(where, protocol)


async def push_load(core: Core, gateways: Gateways) -> None:
    """Tell every connected gateway the engine's state, and the prompt keys gateways
    sent since, when either changes (every ``LOAD_EVERY_S`` at most), and once every
    ``LOAD_AT_LEAST_S`` regardless."""
    loop = asyncio.get_running_loop()
    last: EngineLoad | None = None
    sent_at = 0.0
    while True:
        await asyncio.sleep(LOAD_EVERY_S)
        load = core.engine_load()
        if load is None or (
            load == last and not gateways.prefix and loop.time() - sent_at < LOAD_AT_LEAST_S
        ):
            continue
        keys, gateways.prefix = gateways.prefix, []
        running, waiting, kv_used, adapters, room = load
        frame = p.encode(p.Load(0, running, waiting, kv_used, keys, list(adapters), room))
        for connection in list(gateways.connections):
            writer = connection.writer
            if writer is not None and not writer.transport.is_closing():
                writer.write(frame)
        last, sent_at = load, loop.time()


def make_core(spec: ReplicaSpec) -> Core:
    from inferd.runtimes import GENERATIVE

    if spec.framework in GENERATIVE:
        from inferd.llm.engines import engine_of

        if engine_of(spec.framework, spec.metadata, spec.llm.engine) == "vllm":
            from inferd.serving.vllm_core import VLLMCore

            return VLLMCore(spec)
        from inferd.llm.loader import build_engine
        from inferd.serving.generation import GenerationCore

        return GenerationCore(spec, build_engine)
    return ReplicaCore(spec)


LOAD_FAILED = 3
"""A replica's exit code when its model could not be loaded."""


async def serve(
    spec: ReplicaSpec,
    drain: asyncio.Event,
    grace_s: float,
    kill: asyncio.Event | None = None,
    on_core: Callable[[Core], None] | None = None,
    loading: asyncio.Lock | None = None,
) -> int:
    """Serve ``spec`` on its address until ``drain`` is set, then finish what was
    accepted (at most ``grace_s``, cut short by ``kill``) and stop; the exit code (0, or
    :data:`LOAD_FAILED`). ``on_core`` sees the core (its state) once it exists;
    ``loading``: a lock the loads of replicas sharing a process take one at a time (each
    then measures what its own load added to the process)."""
    loop = asyncio.get_running_loop()
    core = make_core(spec)
    if on_core is not None:
        on_core(core)
    gateways = Gateways()
    fetched: dict[str, float] = {}
    server = await start_listening(core, spec.address, drain, gateways, fetched)
    from inferd.runtimes import GENERATIVE

    # generation replicas tell gateways their engine's state (predict ones have none)
    generative = spec.framework in GENERATIVE
    pusher = loop.create_task(push_load(core, gateways)) if generative else None
    loader = loop.create_task(_fetch_then_load(core, spec, fetched, loading))
    drained = loop.create_task(drain.wait())
    await asyncio.wait([loader, drained], return_when=asyncio.FIRST_COMPLETED)
    if loader.done() and loader.exception() is not None:
        # Answer "failed" with the reason for a moment, so the controller (polling every
        # 50 ms) reads why before it sees the exit code.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(drain.wait(), 1.0)
        if pusher is not None:
            pusher.cancel()
        server.close()
        await core.close()
        if isinstance(server, inprocess.Listener):
            server.disconnect()
        return LOAD_FAILED
    await drained
    loader.cancel()
    core.state = ReplicaState.DRAINING
    logger.info("draining (grace %.0fs)", grace_s)
    deadline = loop.time() + grace_s
    while not core.idle() and loop.time() < deadline and not (kill and kill.is_set()):
        await asyncio.sleep(0.01)
    if pusher is not None:
        pusher.cancel()
    server.close()
    for connection in list(gateways.connections):  # in a shared process: no exit follows
        if connection.transport is not None:
            connection.transport.close()
    await core.close()
    if isinstance(server, inprocess.Listener):
        server.disconnect()
    if spec.address.startswith("unix:"):
        Path(spec.address[5:]).unlink(missing_ok=True)
    logger.info("replica %s stopped", spec.replica_id)
    return 0


async def _fetch_then_load(
    core: Core, spec: ReplicaSpec, fetched: dict[str, float], loading: asyncio.Lock | None
) -> None:
    """Files kept in an object store come into the host's cache first, checked against
    the registered digest (``fetched``: how long that took, the bytes downloaded); a
    failure fails the load with its reason."""
    if spec.artifact_uri.startswith("s3://"):
        try:
            opened = await asyncio.to_thread(fetch_artifact, spec)
            fetched.update(fetch_s=round(opened.seconds, 6), fetched_bytes=opened.fetched_bytes)
            logger.info(
                "%s: %s", spec.artifact_uri,
                f"fetched {opened.fetched_bytes} bytes" if opened.fetched_bytes else "cached",
            )  # fmt: skip
        except Exception as exc:
            core.state, core.message = ReplicaState.FAILED, f"fetching {spec.artifact_uri}: {exc}"
            logger.error("%s", core.message)
            raise
    if loading is None:
        await core.load()
    else:
        async with loading:
            await core.load()


def fetch_artifact(spec: ReplicaSpec, hold: bool = True, verify: bool = False) -> Opened:
    """Open the version's entry in the host's artifact cache (``spec.artifact_dir``),
    downloaded and checked unless another replica of the host already fetched it (with
    ``verify``: and its files still hash to the registered digest). ``hold``: kept from
    eviction while this process lives (see :meth:`ArtifactCache.open`)."""
    from inferd.registry.artifact_cache import ArtifactCache
    from inferd.registry.remote_store import S3Store, download

    bucket = "/".join(spec.artifact_uri.split("/")[:3])  # s3://bucket
    cache = ArtifactCache(Path(spec.artifact_cache_dir), spec.artifact_cache_max_bytes)
    opened = cache.open(
        spec.sha256,
        lambda folder: download(S3Store(bucket), spec.artifact_uri, spec.sha256, folder),
        hold=hold,
        verify=verify,
    )
    if opened.path != Path(spec.artifact_dir):
        raise RuntimeError(f"the cache opened {opened.path}, the spec says {spec.artifact_dir}")
    return opened


async def run_replica(spec: ReplicaSpec, grace_s: float) -> None:
    """The replica process: serve until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    drain = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain.set)
    code = await serve(spec, drain, grace_s)
    if code:
        raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    from inferd.telemetry import tracing
    from inferd.telemetry.logging import configure_logging

    args = sys.argv[1:] if argv is None else argv
    spec = ReplicaSpec.from_json(args[0])
    grace_s = float(args[1]) if len(args) > 1 else 30.0
    if spec.address.startswith("tcp:"):  # reached from other hosts: the cluster's credentials
        from inferd import transport

        transport.use(transport.Credentials.from_env())
    configure_logging(spec.log_level, spec.log_json, f"replica {spec.model}:{spec.version}")
    die_with_parent()
    tracing.configure(
        "replica",
        {
            "inferd.model": spec.model,
            "inferd.version": spec.version,
            "inferd.replica": spec.replica_id,
        },
    )
    code = 0
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(run_replica(spec, grace_s))
        else:
            uvloop.run(run_replica(spec, grace_s))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        tracing.shutdown()
    # The replica has drained and closed. What may still run is a load or a batch in a
    # worker thread (a model stopped while it loads, a predict past the grace period):
    # nothing can interrupt it, and an ordinary exit would join it first. Leave now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
