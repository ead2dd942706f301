"""The ``inprocess`` backend: each replica is a replica core served on this process's
event loop, over in-memory pipes (:mod:`inferd.serving.inprocess`).

Nothing is isolated: a model that crashes the interpreter takes the server with it, and
every model shares this process's memory and GIL (predictions still run on each core's
executor thread, off the loop). What it is for: one process serving models without
children (notebooks, an application embedding inferd) and tests that drive the whole
gateway in milliseconds. The controller and the supervisors use it like any backend.
"""

from __future__ import annotations

import asyncio
import itertools

import msgspec

from inferd.control.backends import ReplicaHandle, probe
from inferd.serving.replica_server import serve
from inferd.shapes.replica_spec import ReplicaSpec


class InProcessReplica(probe.ProbedReplica):
    def __init__(self, spec: ReplicaSpec, incarnation: int, grace_s: float) -> None:
        self.spec = spec
        self.incarnation = incarnation
        self.grace_s = grace_s
        self.drain = asyncio.Event()
        self.kill = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> int:
        return await serve(self.spec, self.drain, self.grace_s, self.kill)

    @property
    def pid(self) -> int:
        return 0  # this process: not a replica's own to report

    @property
    def gone(self) -> bool:
        return self.task.done()

    async def wait_gone(self) -> str:
        try:
            code = await asyncio.shield(self.task)
        except Exception as exc:  # the core failed outside a model load
            return f"failed: {type(exc).__name__}: {exc}"
        return f"exited with code {code}"


class InProcessBackend:
    name = "inprocess"

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._incarnations = itertools.count(1)

    async def start(self, spec: ReplicaSpec) -> ReplicaHandle:
        n = next(self._incarnations)
        if not spec.address:
            spec = msgspec.structs.replace(spec, address=f"inproc:{spec.replica_id}#{n}")
        return InProcessReplica(spec, n, self.grace_s)

    async def stop(self, handle: ReplicaHandle, *, drain: bool = True) -> None:
        assert isinstance(handle, InProcessReplica)
        if not drain:
            handle.kill.set()
        handle.drain.set()
        await asyncio.gather(handle.task, return_exceptions=True)

    async def close(self) -> None:
        pass  # its replicas are tasks of the server's own loop
