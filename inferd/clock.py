"""Time as a seam: the controller's timers read this instead of the time module, so a
test can drive restarts, rollout windows and keep windows without waiting."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime


class Clock:
    """Real time: ``monotonic`` for intervals, ``now`` (UTC) for what is stored."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

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
