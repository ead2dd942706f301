"""The gateway processes: started, watched and restarted by ``inferd serve`` (beside
the controller) or ``inferd gateway`` (following a controller on another host)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from inferd.config import Settings

logger = logging.getLogger(__name__)

SETTINGS_VAR = "INFERD_GATEWAY_SETTINGS"
"""A gateway process's settings (JSON) come in this variable, not on its command line:
they may hold secrets (the cluster token), and the environment is its user's only."""
_ONE_THREAD = {var: "1" for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
"""A gateway does no linear algebra: without these, NumPy starts a BLAS thread per core
in each gateway process at import, to sit idle."""


class GatewayPool:
    def __init__(self, settings: Settings, control: Path | str) -> None:
        self.settings = settings
        self.control = str(control)
        """The server's Unix socket, or ``host:port`` of ``inferd control``."""
        self.processes: list[asyncio.subprocess.Process] = []
        self._watchers: list[asyncio.Task[None]] = []
        self._stopping = False

    async def start(self, timeout_s: float = 60.0) -> None:
        for slot in range(self.settings.gateway_workers):
            self.processes.append(await self._spawn(timeout_s))
            self._watchers.append(asyncio.get_running_loop().create_task(self._watch(slot)))

    async def _spawn(self, timeout_s: float) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "inferd.api.worker",
            self.control,
            env={**os.environ, **_ONE_THREAD, SETTINGS_VAR: self.settings.model_dump_json()},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,  # stopped by the server, in order, not by Ctrl-C
        )
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), timeout_s)
        except TimeoutError:
            line = b""
        except asyncio.CancelledError:  # told to stop while it starts
            await _end(process)
            raise
        if line.strip() != b"LISTENING":
            code = await _end(process)
            raise RuntimeError(
                f"gateway process failed to start on {self.settings.host}:{self.settings.port}"
                f" (exit code {code}; is the port in use? see the log above)"
            )
        return process

    async def _watch(self, slot: int) -> None:
        backoff = 0.5
        while True:
            code = await self.processes[slot].wait()
            if self._stopping:
                return
            logger.error("gateway process %d exited with code %s; restarting", slot, code)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
            try:
                self.processes[slot] = await self._spawn(60.0)
                backoff = 0.5
            except RuntimeError:
                logger.exception("gateway restart failed")

    async def stop(self) -> None:
        """SIGTERM: each gateway stops accepting and finishes in-flight requests."""
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        for process in self.processes:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        grace = self.settings.shutdown_grace_s + 5
        for process in self.processes:
            try:
                await asyncio.wait_for(process.wait(), grace)
            except TimeoutError:
                process.kill()
                await process.wait()


async def _end(process: asyncio.subprocess.Process) -> int | None:
    """Kill a gateway process that did not start (one that died already is only
    reaped: killing it raises ProcessLookupError); its exit code."""
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    return await process.wait()
