"""The in-process tier: the real gateway app, controller, registry and replica cores in
the test process, with no subprocess and no socket.

``InProcessServer`` has the surface tests use of :class:`tests.conftest.InferdServer`
(``client``, ``url``, ``wait_ready``, ``stop``): the same test body runs against
either. Inside, one event loop on a background thread runs the controller with the
``inprocess`` replica backend (replica cores served over in-memory pipes, reached by the
same client and frames as replica processes) and the app ``create_app`` builds for a
gateway process; ``client`` is a synchronous ``httpx.Client`` whose requests run
through ``httpx.ASGITransport`` on that loop.

What it does not have: gateway processes (one app instead of N), the gRPC server, the
table publisher (the controller hands tables to the router directly), the job runner,
``/metrics`` (rendered by the server process) and the inference log writer. Tests of
those stay end to end.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx

from inferd.api.app import create_app
from inferd.api.limits import rate_limits_for
from inferd.config import Settings
from inferd.control.backends.inprocess import InProcessBackend
from inferd.control.controller import Controller
from inferd.registry import Registry
from inferd.routing.cache import cache_for
from inferd.routing.router import Router
from inferd.routing.table import RoutingTable

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
        self.settings = Settings(data_dir=data_dir, reconcile_interval_s=0.3, **settings)
        self.demo = demo
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.registry = Registry.from_settings(self.settings)
        self.router, self.controller, app = self.run(self._start())
        self.client = httpx.Client(
            base_url=self.url, transport=LoopTransport(app, self.loop), timeout=60
        )

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 300) -> T:
        """Run ``coro`` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> tuple[Router, Controller, Any]:
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
        router = Router()

        def publish(table: RoutingTable) -> None:
            self.loop.create_task(router.apply(table))

        controller = Controller(
            self.settings,
            self.registry,
            self.data_dir,
            publish,
            backend=InProcessBackend(self.settings.shutdown_grace_s),
        )
        await controller.start()
        cache = None
        if self.settings.cache.enabled:
            cache = cache_for(self.settings.cache.max_bytes, self.settings.redis_url)
        app = create_app(
            self.settings, router, self.registry, None, cache, rate_limits_for(self.settings)
        )
        return router, controller, app

    def push_source(self, model: str, source: str, version: str = "v1", **metadata: Any) -> None:
        """Register ``source`` (a model.py with one Python model class) as
        ``model:version``, as ``inferd models push`` does, and reconcile."""
        from inferd.runtimes import inspect_artifact

        src = self.data_dir / f"src-{model}-{version}"
        src.mkdir(parents=True)
        (src / "model.py").write_text(source)
        framework, signature = inspect_artifact(src, None, metadata, None)
        self.registry.push(
            model, src, version, framework=framework, signature=signature, metadata=metadata
        )
        self.run(self.controller.reconcile())

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
        self.registry.close()
        return 0

    async def _stop(self) -> None:
        await self.controller.stop()
        self.router.close()
