"""The replica's queue of waiting requests: priority levels, length buckets, admission
and load shedding. The rules are the batcher's (:mod:`inferd.serving.batcher`); this is
where they are kept: which request goes into the next batch, and which is refused or
shed when the queue is full.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import math
from collections import deque
from dataclasses import dataclass

from inferd.errors import Overloaded, RequestTimeout
from inferd.priority import named_levels
from inferd.replica_config import BatchingConfig
from inferd.shapes.replica import Columns

MAX_RETRY_AFTER_S = 60


def priority_name(config: BatchingConfig, level: int) -> str:
    """A level's name in counters: its priority name, else ``level_<n>``."""
    for name, value in named_levels(config).items():
        if value == level and (name != "low" or level != config.priority_levels):
            return name
    return f"level_{level}"


@dataclass(slots=True)
class BatchTrace:
    """A traced request's timing: when it arrived, and, filled when its batch computed,
    the batch's wall-clock start and end (``time.time_ns``, as spans take them) and size."""

    arrived_ns: int = 0
    started_ns: int = 0
    ended_ns: int = 0
    rows: int = 0
    requests: int = 0


@dataclass(slots=True)
class Pending:
    """A queued request (or one piece of a large one)."""

    inputs: Columns
    rows: int
    deadline: float
    future: asyncio.Future[Columns]
    arrived: float = 0.0
    priority: int = 0
    trace: BatchTrace | None = None
    length: int = 0
    """Its longest row (tokens), 0 when rows have no length."""
    tokens: int = 0
    """Sum of its rows' lengths."""
    bucket: int = -1
    """Its length bucket (-1: rows have no length, or buckets are off)."""


@dataclass(slots=True)
class BatchStats:
    batches: int = 0
    rows: int = 0
    requests: int = 0
    expired: int = 0
    rejected: int = 0
    """Refused because the queue was full (or over its level's share)."""
    shed: int = 0
    """Taken out of the queue to make room for a request of a better level."""
    compute_s: float = 0.0
    tokens: int = 0
    """Text models: tokens of the rows computed."""
    padded_tokens: int = 0
    """Text models: tokens computed, padding included (rows x longest row, per batch)."""

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)

    def as_dict(self) -> dict[str, float]:
        stats = {
            "batches": self.batches,
            "rows": self.rows,
            "requests": self.requests,
            "expired": self.expired,
            "rejected": self.rejected,
            "shed": self.shed,
            "compute_s": round(self.compute_s, 6),
        }
        if self.padded_tokens:
            stats["tokens"] = self.tokens
            stats["padded_tokens"] = self.padded_tokens
        return stats


class RequestQueue:
    """Waiting requests by level (only levels with requests are present), the rows they
    hold, and what was refused or shed."""

    def __init__(self, config: BatchingConfig, stats: BatchStats) -> None:
        self.config = config
        self.stats = stats
        self.levels: dict[int, deque[Pending]] = {}
        self.rows = 0
        """Rows queued, pieces of large requests included."""
        self.limits = [
            _admission_limit(config, level) for level in range(config.priority_levels + 1)
        ]
        """Queued rows beyond which a request of each level is refused (index: level)."""
        self.shed_by_level: dict[int, int] = {}
        """Requests refused or shed, per level."""
        self._bounds = sorted(config.length_buckets)

    def bucket(self, length: int) -> int:
        """The length bucket of a request: the first bound it fits under (the last bucket
        holds everything longer than every bound); -1 when buckets are off."""
        return bisect.bisect_left(self._bounds, length) if self._bounds else -1

    def queue_of(self, level: int) -> deque[Pending]:
        queue = self.levels.get(level)
        if queue is None:
            queue = self.levels[level] = deque()
        return queue

    def oldest_arrival(self) -> float:
        return min(queue[0].arrived for queue in self.levels.values())

    def make_room(self, level: int, rows: int) -> bool:
        """Shed queued requests of levels worse than ``level``, newest first, until
        ``rows`` more fit; False (nothing shed) when they cannot be made to fit."""
        limit = self.limits[level]
        worse = sorted((lv for lv in self.levels if lv > level), reverse=True)
        freeable = sum(p.rows for lv in worse for p in self.levels[lv])
        if self.rows - freeable + rows > limit:
            return False
        retry_after = self.retry_after_s()
        for lv in worse:
            queue = self.levels[lv]
            while queue and self.rows + rows > limit:
                item = queue.pop()
                self.rows -= item.rows
                if item.future.done():
                    continue
                self.stats.shed += 1
                self.count_shed(lv)
                item.future.set_exception(Overloaded(
                    "load shedding: taken out of the queue for a higher-priority request",
                    retry_after,
                ))  # fmt: skip
            if not queue:
                del self.levels[lv]
            if self.rows + rows <= limit:
                break
        return True

    def count_shed(self, level: int) -> None:
        self.shed_by_level[level] = self.shed_by_level.get(level, 0) + 1

    def shed_counts(self) -> dict[str, int]:
        """Requests refused or shed, by priority name."""
        return {priority_name(self.config, lv): n for lv, n in sorted(self.shed_by_level.items())}

    def retry_after_s(self) -> int:
        """Seconds the queue takes to empty at the throughput measured so far (1 to 60)."""
        stats = self.stats
        if stats.compute_s <= 0 or stats.rows == 0:
            return 1
        wait = self.rows / (stats.rows / stats.compute_s)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(wait)))

    def take(self, max_rows: int, now: float) -> list[Pending]:
        """The next batch: up to ``max_rows`` rows, best level first, oldest first within a
        level (one length bucket when rows have lengths); expired requests fail here."""
        batch: list[Pending] = []
        rows = 0
        levels = self.levels
        order = sorted(levels) if len(levels) > 1 else list(levels)
        bucket = levels[order[0]][0].bucket  # the oldest best request's
        for level in order:
            queue = levels[level]
            if bucket < 0:
                rows = self._take_level(queue, batch, rows, max_rows, now)
            else:
                rows = self._take_bucket(queue, batch, rows, max_rows, now, bucket)
            if queue:
                break  # the batch is full, or the rest of this level waits for the next
            del levels[level]
        return batch

    def _take_bucket(
        self,
        queue: deque[Pending],
        batch: list[Pending],
        rows: int,
        max_rows: int,
        now: float,
        bucket: int,
    ) -> int:
        """Like :meth:`_take_level`, but only requests of ``bucket``, oldest first; the
        others keep their places in the queue."""
        kept: deque[Pending] = deque()
        while queue:
            item = queue.popleft()
            if item.future.done():
                self.rows -= item.rows
                continue
            if (batch and rows + item.rows > max_rows) or item.bucket != bucket:
                kept.append(item)
                if rows >= max_rows:
                    break
                continue
            self.rows -= item.rows
            if self._expired(item, now):
                continue
            batch.append(item)
            rows += item.rows
        kept.extend(queue)
        queue.clear()
        queue.extend(kept)
        return rows

    def _take_level(
        self, queue: deque[Pending], batch: list[Pending], rows: int, max_rows: int, now: float
    ) -> int:
        while queue:
            item = queue[0]
            if batch and rows + item.rows > max_rows:
                break
            queue.popleft()
            self.rows -= item.rows
            if item.future.done():
                continue
            if self._expired(item, now):
                continue
            batch.append(item)
            rows += item.rows
        return rows

    def _expired(self, item: Pending, now: float) -> bool:
        """Fail ``item`` if its deadline passed while it was queued."""
        if now <= item.deadline:
            return False
        self.stats.expired += 1
        item.future.set_exception(RequestTimeout("request expired in the replica queue"))
        return True


def _admission_limit(config: BatchingConfig, level: int) -> int:
    if level <= config.default_priority:
        return config.max_queue_rows
    share = config.batch_queue_share if level == config.priority_levels else config.low_queue_share
    return max(1, int(config.max_queue_rows * share))
