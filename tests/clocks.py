"""A clock tests move by hand (the :class:`inferd.clock.Clock` seam)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta

from inferd.clock import Clock


async def settle(rounds: int = 50) -> None:
    """Let every task that can run, run (nothing here waits on real time)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class Timer:
    def __init__(self, deadline: float, callback: Callable[[], None]) -> None:
        self.deadline = deadline
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock(Clock):
    """Time moves only when the test says so."""

    def __init__(self) -> None:
        self.t = 0.0
        self.start = datetime.now().astimezone()
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []
        self._timers: list[Timer] = []

    def monotonic(self) -> float:
        return self.t

    def now(self) -> datetime:
        return self.start + timedelta(seconds=self.t)

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.t + seconds, future))
        await future

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(self.t + delay_s, callback)
        self._timers.append(timer)
        return timer

    async def advance(self, seconds: float) -> None:
        self.t += seconds
        for timer in [t for t in self._timers if t.deadline <= self.t]:
            self._timers.remove(timer)
            if not timer.cancelled:
                timer.callback()
        for deadline, future in list(self._sleepers):
            if deadline <= self.t:
                self._sleepers.remove((deadline, future))
                if not future.done():
                    future.set_result(None)
        await settle()
