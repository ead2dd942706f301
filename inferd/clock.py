"""Time as a seam: the controller's timers and the batcher's wait read this instead of
the time module, so a test can drive restarts, rollout windows, keep windows and batch
windows without waiting."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Protocol

logger = logging.getLogger(__name__)


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Clock:
    """Real time: ``monotonic`` for intervals, ``now`` (UTC) for what is stored."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Cancellable:
        """Call ``callback`` on the running loop after ``delay_s``."""
        return asyncio.get_running_loop().call_later(delay_s, callback)

    async def wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        """Wait for ``event`` at most ``timeout_s``; whether it was set."""
        if event.is_set():
            return True
        waiter = asyncio.ensure_future(event.wait())
        sleeper = asyncio.ensure_future(self.sleep(timeout_s))
        try:
            await asyncio.wait((waiter, sleeper), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            sleeper.cancel()
        return event.is_set()


SYSTEM = Clock()


async def every(
    clock: Clock, interval_s: float, run: Callable[[], Awaitable[None]], what: str
) -> None:
    """Run ``run`` every ``interval_s`` (the first after one interval) until cancelled; a
    run that fails is logged and the next one goes ahead (the controller's passes)."""
    while True:
        await clock.sleep(interval_s)
        try:
            await run()
        except Exception:
            logger.exception("%s failed; again in %.1fs", what, interval_s)
