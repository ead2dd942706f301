"""The ``shared`` backend: small versions packed into shared replica processes
(:mod:`inferd.serving.host`), up to ``models.versions_per_process`` in each; the others
(generative models, text models, vLLM, GPU deployments, and a version that crashed or
overran its time budget in a shared process) are the ``local`` backend's, a process each.

A hosted replica is a replica like any other to the supervisor and the controller: its
own id, address (a Unix socket of the run directory), readiness over the replica
protocol, its own ``stop`` (drain) and ``gone``. Its pid is its host's. Packing: a new
replica goes to the host that computed least (measured from its replicas' status, at
most every ``LOOK_EVERY_S``) among those with room — fewer than ``per_process``
replicas, their own memory (``model_bytes``) under ``process_bytes``, under
``CPU_FULL`` of a core — never beside another replica of its own version (two replicas
of a version in one process would share its fate), else to a new host.

Isolation, as the issue asks it: neighbours compute on their own threads; a replica cut
off by its time budget, or present in a host that died twice, is *isolated*: its version's
next replicas run in processes of their own. The budget is kept inside the host, by a
thread (:class:`~inferd.serving.host.Watchdog`); this backend is its backstop: a host
that sends no frame (its beats come every ``WATCH_EVERY_S``) for ``predict_budget_s`` +
``SILENT_GRACE_S`` is killed — its event loop is held, so none of its replicas is
served and no budget can be kept there — and the versions whose compute thread was in a
call then (their :class:`~inferd.serving.compute.BusyMark`) are isolated; its other
replicas restart (not counted as a crash of theirs).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import sys
import time
from collections import Counter
from pathlib import Path

import msgspec

from inferd.control.backends import ReplicaBackend, ReplicaHandle, probe
from inferd.serving.client import status_of
from inferd.serving.compute import busy_since
from inferd.serving.host import CUT_OFF, Gone, Start, Stop, encode, read_frame
from inferd.shapes.replica import ReplicaStats
from inferd.shapes.replica_spec import ReplicaSpec

logger = logging.getLogger(__name__)

SHAREABLE = frozenset({"sklearn", "xgboost", "lightgbm", "onnx", "python", "mlflow"})
"""Frameworks of small models that may share a process (torch and text models, LLMs,
TensorFlow keep their own: their threads and memory are their own business)."""
CRASHES_TO_ISOLATE = 2
"""Host crashes a version was present at before its replicas get their own process."""
CPU_FULL = 0.8
"""A shared process whose replicas computed this share of a core or more (over the last
look) takes no new replica: its neighbours would wait on one another's GIL."""
LOOK_EVERY_S = 2.0
"""How often, at most, a start measures the shared processes (their replicas' status)."""
SILENT_GRACE_S = 5.0
"""A host silent for ``predict_budget_s`` plus this is killed. Beyond the budget, so
that the host's own watchdog cuts a hung batch off first (it answers then); the grace
covers a load or an import holding the interpreter lock for a while."""


class HostedReplica(probe.ProbedReplica):
    def __init__(self, spec: ReplicaSpec, host: Host, incarnation: int) -> None:
        self.spec = spec
        self.host = host
        self.incarnation = incarnation
        self.ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    @property
    def pid(self) -> int:
        return self.host.pid

    @property
    def gone(self) -> bool:
        return self.ended.done()

    async def wait_gone(self) -> str:
        return await asyncio.shield(self.ended)


class Host:
    """One shared replica process and the replicas it serves."""

    def __init__(self, process: asyncio.subprocess.Process, writer: asyncio.StreamWriter) -> None:
        self.process = process
        self.writer = writer
        self.replicas: dict[str, HostedReplica] = {}
        self.model_bytes = 0
        """Its replicas' own memory (their ``model_bytes``), as last measured."""
        self.cpu_share = 0.0
        """The share of a core its replicas computed between the last two looks."""
        self._computed: dict[str, float] = {}
        self._looked_at: float | None = None
        self.silenced = False
        """Killed for its silence."""

    async def look(self, now: float) -> None:
        """Measure its replicas (status over the replica protocol), at most every
        ``LOOK_EVERY_S``: their own memory, and the share of a core they computed since
        the last look (a replica not seen then: since it started)."""
        if self._looked_at is not None and now - self._looked_at < LOOK_EVERY_S:
            return
        replicas = list(self.replicas.values())
        stats = await asyncio.gather(*(_stats_of(r) for r in replicas))
        share, computed = 0.0, {}
        for replica, got in zip(replicas, stats, strict=True):
            if got is None:
                continue
            computed[replica.replica_id] = got.compute_s or 0.0
            before = self._computed.get(replica.replica_id)
            if before is not None and self._looked_at is not None:
                share += max(0.0, computed[replica.replica_id] - before) / (now - self._looked_at)
            elif got.uptime_s:
                share += computed[replica.replica_id] / got.uptime_s
        self.cpu_share = share
        self.model_bytes = sum(int(got.model_bytes or 0) for got in stats if got is not None)
        self._computed, self._looked_at = computed, now

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.returncode is None and not self.writer.is_closing()

    def send(self, frame: Start | Stop) -> None:
        if self.alive:
            self.writer.write(encode(frame))


class SharedBackend:
    name = "shared"

    def __init__(
        self,
        run_dir: Path,
        grace_s: float,
        per_process: int,
        budget_s: float,
        own: ReplicaBackend,
        log_level: str = "INFO",
        process_bytes: int = 4 << 30,
    ) -> None:
        """``own``: the backend of the replicas that get a process of their own;
        ``process_bytes``: a shared process whose replicas' own memory reaches this
        takes no new one."""
        self.run_dir = run_dir
        self.grace_s = grace_s
        self.per_process = per_process
        self.process_bytes = process_bytes
        self.budget_s = budget_s
        self.own = own
        self.log_level = log_level
        self.hosts: list[Host] = []
        self.crashes: Counter[tuple[str, str]] = Counter()
        self.isolated: set[tuple[str, str]] = set()
        """Versions that run in processes of their own from now on, and why."""
        self._sockets = itertools.count(1)
        self._incarnations = itertools.count(1)
        self._lock = asyncio.Lock()

    def shares(self, spec: ReplicaSpec) -> bool:
        return (
            spec.framework in SHAREABLE
            and spec.gpus is None
            and (spec.model, spec.version) not in self.isolated
            and spec.metadata.get("own_process") is not True
        )

    async def start(self, spec: ReplicaSpec) -> ReplicaHandle:
        if not self.shares(spec):
            return await self.own.start(spec)
        n = next(self._sockets)
        if not spec.address:
            spec = msgspec.structs.replace(spec, address=f"unix:{self.run_dir / f's{n}.sock'}")
        busy = str(self.run_dir / f"s{n}.busy")
        spec = msgspec.structs.replace(spec, shared_process=True, busy_file=busy)
        async with self._lock:
            host = await self._host_for(spec)
            replica = HostedReplica(spec, host, next(self._incarnations))
            host.replicas[spec.replica_id] = replica
            host.send(Start(spec.to_json()))
        return replica

    async def close(self) -> None:
        await self.own.close()

    async def stop(self, handle: ReplicaHandle, *, drain: bool = True) -> None:
        if not isinstance(handle, HostedReplica):
            await self.own.stop(handle, drain=drain)
            return
        if handle.gone:
            return
        handle.host.send(Stop(handle.replica_id, drain))
        try:
            await asyncio.wait_for(asyncio.shield(handle.ended), self.grace_s + 5)
        except TimeoutError:  # a replica's thread cannot be stopped: give up on it
            handle.host.replicas.pop(handle.replica_id, None)
            if not handle.ended.done():
                handle.ended.set_result("did not stop within its grace period")

    async def _host_for(self, spec: ReplicaSpec) -> Host:
        """The shared process with room for ``spec`` that computes least (by count,
        measured memory and measured CPU), else a new one."""
        key = (spec.model, spec.version)
        now = time.monotonic()
        await asyncio.gather(*(h.look(now) for h in self.hosts if h.alive))
        fits = [
            h
            for h in self.hosts
            if h.alive
            and len(h.replicas) < self.per_process
            and h.model_bytes < self.process_bytes
            and h.cpu_share < CPU_FULL
            and all((r.spec.model, r.spec.version) != key for r in h.replicas.values())
        ]
        if fits:
            return min(fits, key=lambda h: (h.cpu_share, len(h.replicas)))
        host = await self._spawn(spec)
        self.hosts.append(host)
        return host

    async def _spawn(self, spec: ReplicaSpec) -> Host:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(spec.threads)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "inferd.serving.host", str(theirs.fileno()),
                str(self.grace_s), str(self.budget_s), self.log_level,
                env=env, stdin=asyncio.subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )  # fmt: skip
        finally:
            theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        host = Host(process, writer)
        asyncio.get_running_loop().create_task(self._listen(host, reader))
        logger.info("started shared replica process %d", process.pid)
        return host

    async def _listen(self, host: Host, reader: asyncio.StreamReader) -> None:
        """The host's frames until it ends (or stays silent: killed); then every replica
        it still served is gone. The silence is timed from its first frame on (before
        it, the host starts: imports, no replica yet)."""
        silent_s = self.budget_s + SILENT_GRACE_S
        heard = False
        while True:
            try:  # not wait_for: with a beat arriving as it is cancelled, it kept reading
                async with asyncio.timeout(silent_s if heard else None):
                    frame = await read_frame(reader)
            except TimeoutError:
                self._silenced(host, silent_s)
                break
            if frame is None:
                break
            heard = True
            if isinstance(frame, Gone):
                replica = host.replicas.pop(frame.replica_id, None)
                if replica is None:
                    continue
                Path(replica.spec.busy_file).unlink(missing_ok=True)
                if frame.code == CUT_OFF:
                    self._isolate(replica.spec, frame.reason)
                if not replica.ended.done():
                    replica.ended.set_result(frame.reason)
        code = await host.process.wait()
        host.writer.close()
        if host in self.hosts:
            self.hosts.remove(host)
        suspects = self._suspects(host) if host.silenced else set()
        for replica in list(host.replicas.values()):
            self._lost(host, replica, code, silent_s, suspects)
            Path(replica.spec.busy_file).unlink(missing_ok=True)
        host.replicas.clear()

    def _silenced(self, host: Host, silent_s: float) -> None:
        host.silenced = True
        logger.error(
            "shared replica process %d sent nothing for %gs (models.predict_budget_s + "
            "%gs): its event loop is held (a model holding the interpreter lock in C "
            "code?); killing it", host.pid, silent_s, SILENT_GRACE_S,
        )  # fmt: skip
        with contextlib.suppress(ProcessLookupError):
            host.process.kill()

    def _suspects(self, host: Host) -> set[str]:
        """The replicas of a killed host whose compute thread was in a call."""
        now, found = time.monotonic(), set()
        for replica in host.replicas.values():
            if (started := busy_since(Path(replica.spec.busy_file))) is not None:
                logger.error(
                    "%s:%s was computing for %.1fs when its shared process was killed",
                    replica.spec.model, replica.spec.version, now - started,
                )  # fmt: skip
                found.add(replica.replica_id)
        return found

    def _lost(
        self,
        host: Host,
        replica: HostedReplica,
        code: int,
        silent_s: float,
        suspects: set[str],
    ) -> None:
        """``replica`` ended with its host: isolated if its thread was computing when a
        silent host was killed; else counted as a crash, unless another was the suspect."""
        if replica.replica_id in suspects:
            self._isolate(
                replica.spec,
                f"its shared process stopped answering for {silent_s:g}s while it computed",
            )
        elif not suspects:
            key = (replica.spec.model, replica.spec.version)
            self.crashes[key] += 1
            if self.crashes[key] >= CRASHES_TO_ISOLATE:
                self._isolate(replica.spec, f"its shared process died {self.crashes[key]} times")
        if not replica.ended.done():
            if host.silenced:
                replica.ended.set_result(f"its shared process was silent {silent_s:g}s: killed")
            else:
                replica.ended.set_result(f"its shared process exited with code {code}")

    def _isolate(self, spec: ReplicaSpec, why: str) -> None:
        key = (spec.model, spec.version)
        if key not in self.isolated:
            self.isolated.add(key)
            logger.warning(
                "%s:%s gets a process of its own from now on: %s", spec.model, spec.version, why
            )


async def _stats_of(replica: HostedReplica) -> ReplicaStats | None:
    """A hosted replica's stats (None when it does not answer within a second)."""
    status = await status_of(replica.address, replica.replica_id)
    return status.stats if status is not None else None
