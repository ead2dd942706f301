"""The server process's side of jobs: the runner, callbacks, and upkeep (expired jobs
and files removed, interrupted submissions failed, every ``jobs.upkeep_interval_s``) —
started once the gateways listen."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

from inferd.config import Settings
from inferd.jobs import describe
from inferd.jobs.callbacks import CallbackSender
from inferd.jobs.files import FileStore
from inferd.jobs.queue import SqliteQueue, queue_for
from inferd.jobs.runner import TOPICS, JobRunner
from inferd.jobs.store import JobStore
from inferd.monitoring.exposition import Text
from inferd.registry import Registry

logger = logging.getLogger(__name__)


def gateway_url(settings: Settings) -> str:
    """Where the runner sends requests: ``jobs.gateway_url``, or this server's own
    gateways (a wildcard bind is reached on loopback)."""
    if settings.jobs.gateway_url:
        return settings.jobs.gateway_url.rstrip("/")
    host = settings.host
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if settings.tls.cert_file is not None else "http"
    return f"{scheme}://{host}:{settings.port}"


class JobService:
    def __init__(
        self, settings: Settings, registry: Registry, own_tls: ssl.SSLContext | None = None
    ) -> None:
        """``own_tls``: the TLS client context for this server's own gateways (see
        :func:`inferd.tls.own_gateways_client`); a ``jobs.gateway_url`` is verified the
        usual way (the system's CAs, or ``SSL_CERT_FILE``)."""
        assert settings.auth.internal_token is not None
        cfg = settings.jobs
        self.store = JobStore(registry.engine)
        self.files = FileStore(registry.engine)
        self.upkeep_interval_s = cfg.upkeep_interval_s
        self.queue = queue_for(settings.resolved_queue_url)
        self.callbacks = CallbackSender(
            self.store, describe, cfg.callback_secret, cfg.callback_attempts,
            cfg.callback_timeout_s, cfg.callback_first_delay_s,
        )  # fmt: skip
        self.runner = JobRunner(
            self.store, self.queue, gateway_url(settings), settings.auth.internal_token,
            cfg.concurrency, cfg.lease_s, callbacks=self.callbacks,
            verify=True if cfg.gateway_url or own_tls is None else own_tls,
        )  # fmt: skip
        self._upkeep: asyncio.Task[None] | None = None
        self._callbacks: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if isinstance(self.queue, SqliteQueue):
            released = await asyncio.to_thread(self.queue.release_dead)
            if released:
                logger.info("job queue: %d chunk(s) of a stopped server taken up again", released)
        self.runner.start()
        await self.callbacks.resume()
        loop = asyncio.get_running_loop()
        self._upkeep = loop.create_task(self._upkeep_forever())
        self._callbacks = loop.create_task(self._callbacks_forever())

    async def _callbacks_forever(self, every_s: float = 2.0) -> None:
        """Jobs ended by a gateway (cancelled) or a failure get their callback too."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.callbacks.resume()
            except Exception:
                logger.exception("jobs: looking for pending callbacks failed")

    async def _upkeep_forever(self) -> None:
        while True:
            try:
                purged = await asyncio.to_thread(self.store.purge)
                failed = await asyncio.to_thread(self.store.fail_interrupted)
                gone = await asyncio.to_thread(self.files.purge)
                if purged or failed or gone:
                    logger.info(
                        "jobs: %d expired removed, %d interrupted failed; %d files removed",
                        purged, failed, gone,
                    )  # fmt: skip
            except Exception:
                logger.exception("jobs upkeep failed; retrying later")
            await asyncio.sleep(self.upkeep_interval_s)

    async def write_metrics(self, out: Text) -> None:
        """Jobs by kind and status, queue depth per topic, the runner's item counts."""
        try:
            counts = await asyncio.to_thread(self.store.counts)
            depths = {topic: await self.queue.depth(topic) for topic in TOPICS}
        except Exception:
            logger.exception("reading the jobs for /metrics failed")
            return
        out.family("inferd_jobs", "gauge", "Jobs kept, by kind (batch, request) and status.")
        for (kind, status), n in sorted(counts.items()):
            out.sample("inferd_jobs", {"kind": kind, "status": status}, n)
        out.family("inferd_job_queue_messages", "gauge", "Chunks on the job queue, not acked.")
        for topic, n in depths.items():
            out.sample("inferd_job_queue_messages", {"topic": topic}, n)
        runner = self.runner
        out.family("inferd_job_items_total", "counter", "Job inputs run by this server.")
        for result, n in (("succeeded", runner.items_ok), ("failed", runner.items_failed)):
            out.sample("inferd_job_items_total", {"result": result}, n)
        out.family("inferd_job_chunks_redelivered_total", "counter",
                   "Chunks delivered again (a lease ended: a runner died or stalled).")  # fmt: skip
        out.sample("inferd_job_chunks_redelivered_total", {}, runner.redelivered)

    async def stop(self) -> None:
        for task in (self._upkeep, self._callbacks):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.runner.stop()
        await self.callbacks.close()
        try:
            await asyncio.wait_for(self.queue.close(), 5.0)
        except TimeoutError:
            logger.warning("job queue: closing timed out")
