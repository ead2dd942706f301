"""The in-process tier: the real gateway app, controller, registry and replica cores in
the test process, with no subprocess and no socket.

``InProcessServer`` has the surface tests use of :class:`tests.conftest.InferdServer`
(``client``, ``url``, ``wait_ready``, ``stop``): the same test body runs against
either. Inside, one event loop on a background thread runs the controller with the
``inprocess`` replica backend (replica cores served over in-memory pipes, reached by the
same client and frames as replica processes) and the app a gateway process serves;
``client`` is a synchronous ``httpx.Client`` whose requests run through
``httpx.ASGITransport`` on that loop.

It is the server's own composition without processes: a
:class:`~inferd.control.plane.ControlPlane` (controller, table publisher on a Unix
socket, inference log writer, ``/metrics``) and one gateway app built by
:func:`~inferd.api.worker.build_gateway`, which follows the publisher like a gateway
process does. What it does not have: several gateway processes, the gRPC server and the
job runner (it talks to gateways over HTTP). Tests of those stay end to end.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx

from inferd.api.worker import Gateway, build_gateway
from inferd.config import Settings
from inferd.control.backends.inprocess import InProcessBackend
from inferd.control.plane import ControlPlane
from inferd.registry import Registry
from inferd.routing.cache import prepare_shared, remove_shared

T = TypeVar("T")


class LoopTransport(httpx.BaseTransport):
    """A synchronous transport that runs each request through an ASGI app on another
    thread's event loop."""

    def __init__(self, app: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._asgi = httpx.ASGITransport(app=app)
        self._loop = loop

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()

        async def call() -> httpx.Response:
            forwarded = httpx.Request(
                request.method, request.url, headers=request.headers, content=body
            )
            response = await self._asgi.handle_async_request(forwarded)
            content = await response.aread()
            return httpx.Response(response.status_code, headers=response.headers, content=content)

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result()


class InProcessServer:
    def __init__(self, data_dir: Path, demo: bool = False, **settings: Any) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = data_dir
        self.url = "http://inferd.test"
        self.settings = Settings(
            data_dir=data_dir, reconcile_interval_s=0.3, grpc_port=-1, **settings
        )
        self.demo = demo
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.registry = Registry.from_settings(self.settings)
        self.run_dir = Path(tempfile.mkdtemp(prefix="inferd-t-"))
        self.plane, self.gateway = self.run(self._start())
        self.controller = self.plane.controller
        self.client = httpx.Client(
            base_url=self.url, transport=LoopTransport(self.gateway.app, self.loop), timeout=60
        )

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 300) -> T:
        """Run ``coro`` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> tuple[ControlPlane, Gateway]:
        if self.demo:
            from inferd.demo.install import install_demo

            await asyncio.to_thread(
                install_demo,
                self.registry,
                self.data_dir / "demo-src",
                lambda _: None,
                self.settings.demo_llm,
                self.settings.demo_text,
            )
        # The result cache as `inferd serve` has it: the machine's shared file.
        self.shared_cache = prepare_shared(self.settings)
        backend = InProcessBackend(self.settings.shutdown_grace_s)
        plane = ControlPlane(self.settings, self.registry, self.run_dir, backend)
        await plane.start()
        return plane, await build_gateway(self.settings, plane.control_socket)

    def push_source(
        self, model: str, source: str, version: str = "v1", deploy: bool = False, **metadata: Any
    ) -> None:
        """Register ``source`` (a model.py with one Python model class) as
        ``model:version``, as ``inferd models push`` does (``deploy``: with
        ``--deploy``), and reconcile."""
        from inferd.runtimes import inspect_artifact

        src = self.data_dir / f"src-{model}-{version}"
        src.mkdir(parents=True)
        (src / "model.py").write_text(source)
        framework, signature = inspect_artifact(src, None, metadata, None)
        self.registry.push(
            model,
            src,
            version,
            framework=framework,
            signature=signature,
            metadata=metadata,
            deploy=deploy,
        )
        self.run(self.controller.reconcile())

    def wait_for(
        self, predicate: Callable[[], bool], timeout_s: float = 60, what: str = "condition"
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}")

    def wait_ready(self, timeout_s: float = 120, path: str = "/health/ready") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.client.get(path).status_code == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"not ready after {timeout_s}s: {self.client.get(path).text}")

    def stop(self) -> int:
        self.client.close()
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
        self.registry.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return 0

    async def _stop(self) -> None:
        await self.gateway.close()
        remove_shared(self.shared_cache)
        await self.plane.stop()
