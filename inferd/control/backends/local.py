"""The ``local`` backend: each replica is a process of this machine, listening on a Unix
socket in the run directory: forked from the fork server (:mod:`.forks`, with
``models.fork_server``) or a child process of the server, ``python -m
inferd.serving.replica_server SPEC GRACE`` (vLLM's interpreter, TensorFlow, GPU
replicas, or the fork server failing)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import sys
from pathlib import Path

import msgspec

from inferd.control.backends import ReplicaHandle, probe
from inferd.control.backends.forks import ForkedReplica, ForkFailed, ForkServerClient
from inferd.serving.zygote import forkable
from inferd.shapes.replica_spec import ReplicaSpec

logger = logging.getLogger(__name__)

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class LocalReplica(probe.ProbedReplica):
    """A replica's child process."""

    def __init__(self, spec: ReplicaSpec, process: asyncio.subprocess.Process) -> None:
        self.spec = spec
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def incarnation(self) -> int:
        return self.process.pid

    @property
    def gone(self) -> bool:
        return self.process.returncode is not None

    async def wait_gone(self) -> str:
        code = await self.process.wait()
        return f"exited with code {code}"

    def signal(self, signum: int) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signum)

    async def wait_exit(self) -> None:
        await self.process.wait()


def served_by_vllm(spec: ReplicaSpec) -> bool:
    """Does vLLM's engine serve this replica (:mod:`inferd.llm.engines`)?"""
    from inferd.runtimes import GENERATIVE

    if spec.framework not in GENERATIVE:
        return False
    from inferd.llm.engines import engine_of

    return engine_of(spec.framework, spec.metadata, spec.llm.engine) == "vllm"


def python_for(spec: ReplicaSpec) -> str:
    """The interpreter of a replica: vLLM's environment for a version served by vLLM,
    else this one."""
    if served_by_vllm(spec):
        from inferd.llm.engines import require_vllm

        return require_vllm(spec.llm.vllm_python)
    return sys.executable


class LocalBackend:
    name = "local"

    def __init__(self, run_dir: Path, grace_s: float, fork_server: bool = False) -> None:
        self.run_dir = run_dir
        self.grace_s = grace_s
        self.fork_server = fork_server
        self._sockets = itertools.count(1)
        self._forks: ForkServerClient | None = None
        self._frameworks: set[str] = set()
        """Frameworks a replica was started of: the next ones are forked."""
        self._forks_starting: asyncio.Lock | None = None

    async def start(self, spec: ReplicaSpec) -> ReplicaHandle:
        if not spec.address:
            address = f"unix:{self.run_dir / f'r{next(self._sockets)}.sock'}"
            spec = msgspec.structs.replace(spec, address=address)
        env = dict(os.environ)
        for var in _THREAD_VARS:
            env[var] = str(spec.threads)
        # Spinning OpenMP threads steal the core from everyone else on a busy machine:
        # measured, a GPT-2 decode step with one core taken went from ~1050 ms to ~190 ms.
        # Not under vLLM, which binds its worker's threads to the cores and waits for
        # them in a spin of its own (its engine core's shared-memory queue): with
        # passive threads that spin took 8.6 CPU-seconds a run from the worker, and
        # inferd on vLLM gave 0.92x the output tokens/s of vLLM's own server
        # (bench/vllm_bench_serve.py; 1.5 CPU-seconds, as there, without).
        if not served_by_vllm(spec):
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if spec.gpus is not None:  # the deployment asked for a GPU type: only those
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.gpus))
        python = await asyncio.to_thread(python_for, spec)  # may ask an interpreter (once)
        if self._forked(spec, python):
            try:
                return await (await self._fork_server()).fork(spec, self.grace_s, env)
            except ForkFailed as exc:
                logger.warning("%s: %s; starting it from scratch", spec.replica_id, exc)
        process = await asyncio.create_subprocess_exec(
            python,
            "-m",
            "inferd.serving.replica_server",
            spec.to_json(),
            str(self.grace_s),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            # Own session: a terminal's Ctrl-C reaches only the server, which then
            # stops gateways and replicas in order.
            start_new_session=True,
        )
        return LocalReplica(spec, process)

    async def stop(self, handle: ReplicaHandle, *, drain: bool = True) -> None:
        """SIGTERM (the replica drains), then SIGKILL after the grace period; at once
        without ``drain``. Forked or a child of the server alike."""
        assert isinstance(handle, LocalReplica | ForkedReplica)
        if not handle.gone:
            if not drain:
                handle.signal(signal.SIGKILL)
            else:
                handle.signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(handle.wait_exit(), self.grace_s + 5)
                except TimeoutError:
                    handle.signal(signal.SIGKILL)
        await handle.wait_exit()

    def _forked(self, spec: ReplicaSpec, python: str) -> bool:
        """Fork this replica? Not the first of its framework: a server whose replicas
        each start once (one version per framework, never restarted, never scaled)
        runs no fork server and holds none of its memory; a second start of a framework
        (a restart, a scale-up, a start from zero, another version) starts it."""
        if not self.fork_server or python != sys.executable:
            return False
        if not forkable(spec.framework, spec.gpus):
            return False
        if spec.framework not in self._frameworks:
            self._frameworks.add(spec.framework)
            return False
        return True

    async def _fork_server(self) -> ForkServerClient:
        """The fork server, started at the first replica forked (again after it died)."""
        if self._forks_starting is None:
            self._forks_starting = asyncio.Lock()
        async with self._forks_starting:
            if self._forks is None or not self._forks.alive:
                self._forks = await ForkServerClient.start(
                    {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
                )
            return self._forks

    async def close(self) -> None:
        """Stop the fork server (after the replicas: a replica outliving it would get
        SIGTERM as it goes)."""
        if self._forks is not None:
            await self._forks.aclose()
            self._forks = None
