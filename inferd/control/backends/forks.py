"""The server's side of its fork server (:mod:`inferd.serving.zygote`): replica processes
forked from a process that has their code and framework imported already, so starting
one (a scale-up, a restart, a version loaded on demand or from zero) costs what loading
the model costs, not what importing Python's libraries does.

The fork server is the replicas' parent, so the server holds each one by its pidfd (sent
with the :class:`~inferd.shapes.fork.Forked` frame): signals go to that process and no
other, whatever pids get reused, and the pidfd turning readable is its end. The exit
code comes from the fork server, which reaps it. A fork server that dies takes its
replicas with it (they die with their parent, as every replica does with the server);
the next start starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import sys

from inferd.control.backends import probe
from inferd.shapes.fork import MAX_FRAME, Exited, Failed, Fork, Forked, decode, encode
from inferd.shapes.replica_spec import ReplicaSpec

logger = logging.getLogger(__name__)

FORK_TIMEOUT_S = 60.0
"""A fork answers within this (it may import a framework first)."""
CODE_WAIT_S = 2.0
"""After a replica's pidfd says it ended, how long its exit code may take to come."""


class ForkFailed(Exception):
    """The fork server did not fork (it is gone, or ``fork`` failed): start the replica
    from scratch."""


class ForkedReplica(probe.ProbedReplica):
    """A replica process the fork server forked, held by its pidfd."""

    def __init__(self, spec: ReplicaSpec, pid: int, pidfd: int) -> None:
        self.spec = spec
        self._pid = pid
        self.pidfd: int | None = pidfd
        loop = asyncio.get_running_loop()
        self.ended: asyncio.Future[None] = loop.create_future()
        self.code: asyncio.Future[int] = loop.create_future()
        loop.add_reader(pidfd, self._ended)

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def incarnation(self) -> int:
        return self._pid

    @property
    def gone(self) -> bool:
        return self.ended.done()

    def _ended(self) -> None:
        self._close()
        if not self.ended.done():
            self.ended.set_result(None)

    def _close(self) -> None:
        if self.pidfd is not None:
            asyncio.get_running_loop().remove_reader(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None

    def exited(self, code: int) -> None:
        if not self.code.done():
            self.code.set_result(code)

    def signal(self, signum: int) -> None:
        if self.pidfd is None:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signum)

    async def wait_gone(self) -> str:
        await asyncio.shield(self.ended)
        try:
            code = await asyncio.wait_for(asyncio.shield(self.code), CODE_WAIT_S)
        except TimeoutError:
            return "exited (its fork server is gone)"
        return f"exited with code {code}"

    async def wait_exit(self) -> None:
        await asyncio.shield(self.ended)


class ForkServerClient:
    """One fork server process and the replicas it forked."""

    def __init__(self, process: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self.process = process
        self.sock = sock
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[tuple[int, int]]] = {}
        self._replicas: dict[int, ForkedReplica] = {}
        self.closed = False
        asyncio.get_running_loop().add_reader(sock, self._readable)

    @classmethod
    async def start(cls, env: dict[str, str]) -> ForkServerClient:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "inferd.serving.zygote", str(theirs.fileno()),
                env=env, stdin=asyncio.subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(process, ours)

    @property
    def alive(self) -> bool:
        return not self.closed and self.process.returncode is None

    async def fork(self, spec: ReplicaSpec, grace_s: float, env: dict[str, str]) -> ForkedReplica:
        if not self.alive:
            raise ForkFailed("the fork server is gone")
        request_id = next(self._ids)
        waiting = self._waiting[request_id] = asyncio.get_running_loop().create_future()
        frame = Fork(
            request_id=request_id, spec=spec.to_json(), grace_s=grace_s,
            framework=spec.framework, threads=spec.threads, env=env,
        )  # fmt: skip
        try:
            await asyncio.get_running_loop().sock_sendall(self.sock, encode(frame))
            pid, pidfd = await asyncio.wait_for(asyncio.shield(waiting), FORK_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            raise ForkFailed(f"the fork server did not answer: {exc!r}") from None
        finally:
            self._waiting.pop(request_id, None)
        replica = self._replicas[pid] = ForkedReplica(spec, pid, pidfd)
        return replica

    def _readable(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, MAX_FRAME, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            if not data:
                self._lost()
                return
            frame = decode(data)
            if isinstance(frame, Forked):
                self._answer(frame.request_id, (frame.pid, fds[0]), fds)
            elif isinstance(frame, Failed):
                self._answer(frame.request_id, ForkFailed(frame.message), fds)
            elif isinstance(frame, Exited):
                replica = self._replicas.pop(frame.pid, None)
                if replica is not None:
                    replica.exited(frame.code)

    def _answer(self, request_id: int, answer: tuple[int, int] | Exception, fds: list[int]) -> None:
        waiting = self._waiting.get(request_id)
        if waiting is None or waiting.done():  # it timed out meanwhile: let the child go
            if fds:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fds[0], signal.SIGKILL)
                os.close(fds[0])
            return
        if isinstance(answer, Exception):
            waiting.set_exception(answer)
        else:
            waiting.set_result(answer)

    def _lost(self) -> None:
        if self.closed:
            return
        logger.warning("the replicas' fork server is gone; the next replica starts a new one")
        self.close()

    def close(self) -> None:
        """Stop the fork server (its end of the socket closes: it leaves). Replicas it
        forked that still run get SIGTERM as it goes (they die with their parent)."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.sock)
        self.sock.close()
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(ForkFailed("the fork server is gone"))

    async def aclose(self) -> None:
        self.close()
        try:
            await asyncio.wait_for(self.process.wait(), 5.0)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
