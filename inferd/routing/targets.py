"""Where a request can go, as one routing table says: a model version with its signature
(:class:`Target`), the version its requests are mirrored to (:class:`Shadow`), a traffic
split over versions (:class:`Split`), and the lookups of all three (:class:`Routes`,
built once for each table a gateway applies, read by every request)."""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

from inferd.errors import InferdError, ModelNotFound, ModelNotReady
from inferd.serving.client import ReplicaClient
from inferd.shapes.control import ModelRoute, RoutingTable, VersionRoute
from inferd.shapes.graph import GRAPH_FRAMEWORK as GRAPH
from inferd.shapes.tensors import Signature

logger = logging.getLogger(__name__)


class Split:
    """A traffic split over versions with ready replicas: cumulative shares in a fixed
    order (newest version first). A request falls at a point in [0, total): a random one,
    or, with a user key, a hash of it, so a user keeps a version, and moving the split
    by x % moves only the users in that x % (the ranges grow or shrink at their ends)."""

    __slots__ = ("bounds", "targets", "total")

    def __init__(self, shares: list[tuple[int, Target]]) -> None:
        bounds, total = [], 0
        for pct, _ in shares:
            total += pct
            bounds.append(total)
        self.bounds = bounds
        self.targets = [t for _, t in shares]
        self.total = total

    def choose(self, user: str | None = None) -> Target:
        point = (random.random() if user is None else user_point(user)) * self.total
        for bound, target in zip(self.bounds, self.targets, strict=True):
            if point < bound:
                return target
        return self.targets[-1]


def user_point(user: str) -> float:
    """A user's fixed point in [0, 1)."""
    digest = hashlib.blake2b(user.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def split_of(
    route: ModelRoute,
    ready: dict[tuple[str, str], list[ReplicaClient]],
    targets: dict[tuple[str, str], Target],
) -> Split | None:
    """The model's split over its versions that have ready replicas (None: no split,
    requests go to the serving version)."""
    shares = [
        (pct, targets[(route.name, version)])
        for version, pct in route.traffic.items()
        if pct > 0
        and (route.name, version) in targets
        and (ready.get((route.name, version)) or targets[(route.name, version)].framework == GRAPH)
    ]
    if len(shares) < 2:
        return None
    return Split(shares)


@dataclass(frozen=True, slots=True)
class Target:
    """A model version that can receive a request, with its decoded signature."""

    model: str
    version: str
    signature: Signature
    framework: str
    allow_non_finite: bool = False
    """Float inputs may be NaN or ±Infinity (the version's metadata says so)."""


@dataclass(frozen=True, slots=True)
class Shadow:
    """Where a model's requests are mirrored: ``fraction`` of them, compared with the live
    answers within ``tolerance``."""

    target: Target
    fraction: float
    tolerance: float


class Routes:
    """One routing table's targets, splits and shadows, and the ready replicas of each
    version this gateway is connected to: swapped whole when a table is applied, so a
    lookup always sees one table."""

    __slots__ = ("coming", "ready", "shadows", "splits", "table", "targets")
    targets: dict[tuple[str, str], Target]

    def __init__(
        self,
        table: RoutingTable,
        ready: dict[tuple[str, str], list[ReplicaClient]],
        previous: Routes | None = None,
        coming: Callable[[ModelRoute], str | None] = lambda route: None,
    ) -> None:
        self.table = table
        self.ready = ready
        self.coming = coming
        """With no version ready: the one a request should wait for (see
        :meth:`inferd.routing.holds.Holds.coming_version`)."""
        known: dict[tuple[str, str], Target] = {} if previous is None else previous.targets
        targets: dict[tuple[str, str], Target] = {}
        for model in table.models.values():
            for vroute in model.versions.values():
                key = (model.name, vroute.version)
                found = known.get(key)
                if found is None or found.allow_non_finite != vroute.allow_non_finite:
                    found = Target(
                        model.name,
                        vroute.version,
                        vroute.signature,
                        vroute.framework,
                        vroute.allow_non_finite,
                    )
                targets[key] = found
        self.targets = targets
        self.splits = {
            model.name: split
            for model in table.models.values()
            if (split := split_of(model, ready, targets)) is not None
        }
        """Models whose unpinned requests are split between versions."""
        self.shadows = {
            model.name: Shadow(targets[(model.name, v.version)], v.mirror_pct / 100, v.tolerance)
            for model in table.models.values()
            for v in model.versions.values()
            if v.mirror_pct > 0 and ready.get((model.name, v.version))
        }
        """Models with a shadow version that has ready replicas."""

    def model(self, name: str) -> ModelRoute:
        route = self.table.models.get(name)
        if route is None:
            raise ModelNotFound(f"model {name!r} not found", model=name)
        return route

    def version_route(self, model: str, version: str) -> VersionRoute | None:
        route = self.table.models.get(model)
        return route.versions.get(version) if route else None

    def target(self, model: str, version: str | None = None, user: str | None = None) -> Target:
        """The version a request goes to: ``version`` when pinned, else by the model's
        traffic split (the same ``user`` always lands on the same version while the split
        holds), else the serving version."""
        if version is None and (split := self.splits.get(model)) is not None:
            return split.choose(user)
        route = self.model(model)
        if version is None:
            version = route.default_version
            if version is None and not route.loaded:
                raise ModelNotReady(
                    f"model {model!r} is unloaded; load it with "
                    f"POST /v2/repository/models/{model}/load",
                    model=model,
                )
            if version is None:
                version = self.coming(route)
            if version is None:
                raise ModelNotReady(f"model {model!r} has no ready version yet", model=model)
        elif version not in route.versions:
            raise ModelNotFound(
                f"version {version!r} of model {model!r} is not deployed",
                model=model,
                version=version,
            )
        return self.targets[(model, version)]

    def resolve(self, name: str, version: str | None = None) -> tuple[Target, str | None]:
        """A model name, an adapter name registered with a model, or ``base:adapter``
        (an adapter loaded at run time) -> the serving target and the adapter."""
        if name in self.table.models:
            return self.target(name, version), None
        base, sep, adapter = name.partition(":")
        if sep and base in self.table.models and adapter:
            return self.target(base, version), adapter
        for model in self.table.models.values():
            serving = model.versions.get(model.default_version or "")
            if serving is not None and name in serving.adapters:
                return self.target(model.name, version), name
        raise ModelNotFound(f"model {name!r} not found", model=name)

    def shadow_of(self, model: str) -> Shadow | None:
        """The model's shadow version, when it has one that can take mirrored requests."""
        return self.shadows.get(model) if self.shadows else None

    def fallback_for(self, target: Target) -> Target | None:
        """Where a request ``target`` failed goes next: the model's serving version, if
        it is another one, has ready replicas, and ``target``'s deployment allows it."""
        route = self.table.models.get(target.model)
        if route is None or route.default_version in (None, target.version):
            return None
        failed = route.versions.get(target.version)
        if failed is None or not failed.fallback:
            return None
        key = (target.model, route.default_version)
        found = self.targets.get(key)
        ready = self.ready.get(key) or (found is not None and found.framework == GRAPH)
        return found if ready else None

    def overflow_for(self, target: Target) -> Target | None:
        """Where a request goes while ``target`` is saturated: its version's overflow
        model (serving version), if it is served and takes the same inputs."""
        route = self.version_route(target.model, target.version)
        name = None if route is None else route.overflow_model
        if name is None:
            return None
        try:
            overflow = self.target(name)
        except InferdError:
            return None
        mine = {(t.name, t.datatype) for t in target.signature.inputs}
        if {(t.name, t.datatype) for t in overflow.signature.inputs} != mine:
            logger.warning(
                "overflow model %s of %s:%s takes other inputs; not used",
                name, target.model, target.version,
            )  # fmt: skip
            return None
        return overflow if self.ready.get((overflow.model, overflow.version)) else None
