"""Input drift, the server's side: every ``drift.interval_s`` the monitor asks each ready
predict replica for its counts (:class:`~inferd.shapes.replica.DriftQuery`, over a
connection kept per replica), differences them into a rolling window per version and
scores the window against the version's reference profile
(:mod:`inferd.monitoring.drift_stats`). ``/metrics`` (``inferd_drift_*``, which the
shipped ``InferdInputDrift`` rule reads), the console and ``GET
/api/v1/models/{model}/versions/{version}/drift`` read the last scores.

The reference is the version's row in ``drift_references`` (a registered sample's,
written at push), handed to each replica that does not count on it yet. A version with
none: each replica builds one from its first ``drift.reference_rows`` rows; the first
reported is written (the first write wins) and handed to all of them, so that they count
on the same bins; a restarted server reads it back.

Counts are cumulative per replica counter (a replica's ``since``: a restart or a new
profile starts another); each look adds what every replica counted since the last one
to the window. A counter first seen now counts from now on, unless it began after the
last look (a new replica): a restarted server does not take hours of counts for a
minute's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from inferd.control.state import reachable
from inferd.errors import InferdError, InvalidInput, ModelNotFound
from inferd.monitoring.drift_stats import Counts, DriftWindow, embedding_distances, scores
from inferd.monitoring.exposition import ReplicaStatuses, Text
from inferd.runtimes import GENERATIVE
from inferd.serving.client import ReplicaClient
from inferd.shapes.drift import Profile
from inferd.shapes.replica import DriftCounts, DriftQuery

if TYPE_CHECKING:
    from inferd.config import DriftConfig
    from inferd.control.controller import Controller
    from inferd.registry import Registry

logger = logging.getLogger(__name__)

DRIFT_VERSION_GAUGES = {
    "window_rows": (
        "inferd_drift_window_rows",
        "Rows in the version's current drift window (drift.window_rows, no older than "
        "drift.window_s).",
    ),
    "reference_rows": (
        "inferd_drift_reference_rows",
        "Rows the version's drift reference was built from (0: none yet).",
    ),
    "drifted": (
        "inferd_drift_features_drifted",
        "Features of the version whose PSI is at or over its threshold.",
    ),
}
DRIFT_FEATURE_GAUGES = {
    "psi": (
        "inferd_drift_psi",
        "Population stability index of a feature's inputs in the window against the "
        "version's reference.",
    ),
    "ks": (
        "inferd_drift_ks",
        "Kolmogorov-Smirnov statistic of a numeric feature's window against the reference "
        "(on the reference's decile bins).",
    ),
    "threshold": (
        "inferd_drift_psi_threshold",
        "PSI at or over which the feature is flagged (drift.psi_threshold, or the "
        "version's drift_psi_threshold metadata).",
    ),
}


@dataclass
class _Seen:
    """A replica's counter as last seen."""

    since: float
    digest: str
    provisional: bool
    """It reported a profile of its own (not handed one yet)."""
    collected: int
    """Rows it keeps towards a profile of its own (it has none yet)."""
    counts: Counts


class VersionDrift:
    """One running version: its reference, its window and its last scores."""

    def __init__(self, model: str, version: str, threshold: float) -> None:
        self.model, self.version = model, version
        self.threshold = threshold
        self.reference: Profile | None = None
        self.read = False
        """The registry was read for its reference."""
        self.window = DriftWindow()
        self.seen: dict[str, _Seen] = {}
        self.looked_at = time.time()
        self.collected = 0
        """Rows its replicas keep towards a reference of their own (none yet)."""
        self.answered = 0
        """Replicas whose counts the last look got."""
        self.unsupported: str | None = None
        """Why its replicas count nothing (a generative model)."""
        self.current: Counts | None = None
        self.scores: list[dict[str, Any]] = []
        self.embeddings: list[dict[str, Any]] = []
        """Its embeddings' distances (:func:`embedding_distances`) in the last scores."""

    def figure(self, key: str) -> float:
        if key == "window_rows":
            return 0 if self.current is None else self.current.rows
        if key == "reference_rows":
            return 0 if self.reference is None else self.reference.rows
        return sum(entry["drifted"] for entry in self.scores)

    def query(self, replica: str, config: DriftConfig) -> DriftQuery:
        """What to ask ``replica``: with the reference when it does not count on it."""
        seen, reference = self.seen.get(replica), self.reference
        handing = reference is not None and (
            seen is None or seen.digest != reference.digest or seen.provisional
        )
        profile = reference if handing else None
        return DriftQuery(
            0, profile, config.reference_rows, config.max_categories, config.max_rows_per_s
        )

    def take(self, replica: str, reply: DriftCounts, now: float) -> Counts | None:
        """What ``replica`` counted on the reference since the last look (None: nothing
        that counts)."""
        before = self.seen.get(replica)
        mine = Counts(
            reply.since, now, reply.rows, np.asarray(reply.counts, np.int64),
            np.asarray(reply.sums), np.asarray(reply.squares),
        )  # fmt: skip
        provisional = reply.profile is not None
        self.seen[replica] = _Seen(reply.since, reply.digest, provisional, reply.collected, mine)
        if self.reference is None or reply.digest != self.reference.digest:
            return None
        if before is None or before.since != reply.since or before.digest != reply.digest:
            # a counter new to this monitor: all of it, if it began since the last look
            return mine if now - reply.age_s >= self.looked_at else None
        was = before.counts
        return Counts(
            was.until, now, mine.rows - was.rows, mine.counts - was.counts,
            mine.sums - was.sums, mine.squares - was.squares,
        )  # fmt: skip


class DriftMonitor:
    def __init__(self, config: DriftConfig, controller: Controller, registry: Registry) -> None:
        self.config = config
        self.controller = controller
        self.registry = registry
        self.versions: dict[tuple[str, str], VersionDrift] = {}
        self.clients = ReplicaStatuses()
        """A connection kept per predict replica (not the ``/metrics`` ones: this asks
        fewer replicas, and would close those connections to the others)."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.config.enabled:
            self._task = asyncio.get_running_loop().create_task(self._watch_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.clients.close()

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.look()
            except Exception:
                logger.exception("collecting input drift counts failed")

    def _running(self) -> dict[tuple[str, str], float]:
        """Running predict versions -> their PSI threshold."""
        out = {}
        for name, model in self.controller.models.items():
            for version, vset in model.versions.items():
                if vset.record.framework in GENERATIVE:
                    continue
                given: Any = vset.record.metadata.get("drift_psi_threshold")
                valid = isinstance(given, int | float) and not isinstance(given, bool) and given > 0
                out[(name, version)] = float(given) if valid else self.config.psi_threshold
        return out

    async def look(self) -> None:
        """One collection: every ready replica's counts into its version's window."""
        await self._follow(self._running())
        asked = [
            (labels, address)
            for labels, address in reachable(self.controller.models)
            if (known := self.versions.get((labels["model"], labels["version"]))) is not None
            and known.unsupported is None
        ]
        replies = await self.clients(asked, min(self.config.interval_s, 5.0), self._ask)
        now = time.time()
        added: dict[tuple[str, str], list[Counts]] = {key: [] for key in self.versions}
        for state in self.versions.values():
            state.answered = 0
        for labels, reply in replies:
            key = (labels["model"], labels["version"])
            state = self.versions[key]
            state.answered += 1
            if isinstance(reply, InferdError):
                state.unsupported = reply.message
                continue
            if reply.profile is not None and state.reference is None:
                await self._adopt(state, reply.profile)
            if (taken := state.take(labels["replica"], reply, now)) is not None:
                added[key].append(taken)
        present = {(lab["model"], lab["version"], lab["replica"]) for lab, _ in asked}
        for key, counted in added.items():
            state = self.versions[key]
            state.seen = {r: s for r, s in state.seen.items() if (*key, r) in present}
            self._advance(state, counted, now)

    async def _follow(self, running: dict[tuple[str, str], float]) -> None:
        """Versions as they run now: gone ones forgotten, new ones' references read."""
        for key in set(self.versions) - set(running):
            del self.versions[key]
        for key, threshold in running.items():
            state = self.versions.setdefault(key, VersionDrift(*key, threshold))
            state.threshold = threshold
            if not state.read:
                try:
                    found = await asyncio.to_thread(self.registry.drift_references.get, *key)
                except ModelNotFound:  # deleted since the controller's last pass
                    found = None
                state.reference = None if found is None else Profile.from_dict(found)
                state.read = True

    async def _ask(self, client: ReplicaClient, labels: dict[str, str], timeout_s: float) -> Any:
        state = self.versions[(labels["model"], labels["version"])]
        query = state.query(labels["replica"], self.config)
        try:
            return await client.drift(query, timeout_s)
        except InvalidInput as exc:  # a replica that counts nothing: asked no more
            return exc

    async def _adopt(self, state: VersionDrift, profile: Profile) -> None:
        """A replica's profile from its first rows becomes the version's reference (or
        the one another process wrote first does)."""
        try:
            kept = await asyncio.to_thread(
                self.registry.drift_references.keep,
                state.model,
                state.version,
                profile.to_dict(),
            )
        except ModelNotFound:  # deleted meanwhile
            return
        state.reference = Profile.from_dict(kept)
        logger.info(
            "input drift: %s:%s's reference is its first %d rows",
            state.model, state.version, state.reference.rows,
        )  # fmt: skip

    def _advance(self, state: VersionDrift, added: list[Counts], now: float) -> None:
        state.collected = max((s.collected for s in state.seen.values()), default=0)
        if added:
            total = added[0]
            for counts in added[1:]:
                total = total + counts
            state.window.add(total)
        state.looked_at = now
        config = self.config
        state.current = state.window.current(now, config.window_rows, config.window_s)
        ready = state.reference is not None and state.current is not None
        if ready and state.current.rows >= config.min_window_rows:  # type: ignore[union-attr]
            state.scores = scores(state.reference, state.current, state.threshold)  # type: ignore[arg-type]
            state.embeddings = embedding_distances(state.reference, state.scores)  # type: ignore[arg-type]
        else:
            state.scores, state.embeddings = [], []

    # -- the API's answer ---------------------------------------------------------------

    async def answer(self, model: str, version: str | None) -> dict[str, Any]:
        """The drift view of ``model:version`` (its serving version when None); an
        ``error`` (code, message) for a model or version that does not exist."""
        try:
            if version is None:
                version = await self._serving(model)
            state = self.versions.get((model, version))
            if state is None:  # registered, not running here: its reference, no window
                found = await asyncio.to_thread(self.registry.drift_references.get, model, version)
                state = VersionDrift(model, version, self.config.psi_threshold)
                state.reference = None if found is None else Profile.from_dict(found)
                return self._view(state, "not_running")
        except ModelNotFound as exc:
            return {"error": {"code": exc.code, "message": exc.message}}
        return self._view(state, self._status(state))

    async def _serving(self, model: str) -> str:
        state = self.controller.models.get(model)
        if state is not None and state.serving is not None:
            return state.serving
        await asyncio.to_thread(self.registry.get_model, model)  # 404 when unknown
        raise ModelNotFound(f"model {model!r} has no serving version", model=model)

    def _status(self, state: VersionDrift) -> str:
        if not self.config.enabled:
            return "disabled"
        if state.unsupported is not None:
            return "unsupported"
        if state.reference is None:
            return "collecting"
        if not state.scores:
            return "warming"
        return "drifted" if any(e["drifted"] for e in state.scores) else "ok"

    def _view(self, state: VersionDrift, status: str) -> dict[str, Any]:
        config, current, reference = self.config, state.current, state.reference
        return {
            "model": state.model,
            "version": state.version,
            "status": status,
            "message": state.unsupported,
            "threshold": {"psi": state.threshold},
            "reference": None if reference is None else _reference_view(reference),
            "collected_rows": state.collected if reference is None else None,
            "replicas": state.answered,
            "window": {
                "rows": 0 if current is None else current.rows,
                "since": None if current is None else current.since,
                "until": None if current is None else current.until,
                "target_rows": config.window_rows,
                "min_rows": config.min_window_rows,
                "max_age_s": config.window_s,
            },
            "features": state.scores,
            "embeddings": state.embeddings,
            "drifted": [e["name"] for e in state.scores if e["drifted"]],
        }

    # -- /metrics -----------------------------------------------------------------------

    def write_metrics(self, out: Text) -> None:
        write_drift(out, [s for s in self.versions.values() if s.reference is not None])


def _reference_view(reference: Profile) -> dict[str, Any]:
    return {
        "source": reference.source,
        "rows": reference.rows,
        "digest": reference.digest,
        "features": [
            {
                "name": f.name,
                "kind": f.kind,
                "input": f.input,
                "mean": f.mean,
                "std": f.std,
                "bins": len(f.counts),
                "categories": f.categories or None,
            }
            for f in reference.features
        ],
        "embeddings": [
            {
                "name": p.tensor,
                "output": p.output,
                "dimensions": len(p.center),
                "directions": len(p.directions),
            }
            for p in reference.projections
        ],
    }


def write_drift(out: Text, versions: list[VersionDrift]) -> None:
    """Per version with a reference, and per feature of its last scores."""
    if not versions:
        return
    for key, (name, help_) in DRIFT_VERSION_GAUGES.items():
        out.family(name, "gauge", help_)
        for state in versions:
            out.sample(name, {"model": state.model, "version": state.version}, state.figure(key))
    for key, (name, help_) in DRIFT_FEATURE_GAUGES.items():
        out.family(name, "gauge", help_)
        for state in versions:
            for entry in state.scores:
                value = state.threshold if key == "threshold" else entry.get(key)
                if value is not None:
                    feature = entry["name"]
                    labels = {"model": state.model, "version": state.version, "feature": feature}
                    out.sample(name, labels, value)
    _write_embeddings(out, versions)
    out.family(
        "inferd_drift_p_value",
        "gauge",
        "p-value of a feature's window against the reference: Kolmogorov-Smirnov (numeric) "
        "or chi-squared (categorical), by test.",
    )
    for state in versions:
        for entry in state.scores:
            test = "ks" if "ks_p_value" in entry else "chi2"
            labels = {
                "model": state.model, "version": state.version, "feature": entry["name"],
                "test": test,
            }  # fmt: skip
            out.sample("inferd_drift_p_value", labels, entry[f"{test}_p_value"])


def _write_embeddings(out: Text, versions: list[VersionDrift]) -> None:
    if not any(state.embeddings for state in versions):
        return
    out.family(
        "inferd_drift_embedding_distance",
        "gauge",
        "How far the window's mean embedding moved from the reference's over its principal "
        "directions, in reference standard deviations (Mahalanobis), by embedding.",
    )
    for state in versions:
        for entry in state.embeddings:
            if entry["distance"] is not None:
                labels = {"model": state.model, "version": state.version,
                          "embedding": entry["name"]}  # fmt: skip
                out.sample("inferd_drift_embedding_distance", labels, entry["distance"])
