"""``DataPlane.resolve``: how every transport and the graph runner find a request's target
(the table; else a model or version just deployed, waited for within the request's
deadline; else 404), then have the caller's policy admit it. Unit tests: no sockets."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from inferd.errors import Forbidden, ModelNotFound, ModelNotReady
from inferd.routing.dataplane import DataPlane
from inferd.routing.router import Router
from inferd.routing.targets import Routes, Target
from inferd.shapes.control import ModelRoute, RoutingTable, VersionRoute
from inferd.shapes.tensors import Signature


def _plane(deployed: bool | None = None) -> DataPlane:
    """A data plane over a table listing ``m`` (version ``v1``); ``deployed``: what the
    registry says of what the table does not list (None: no registry to ask)."""
    router = Router(hold_timeout_s=5, hold_max_requests=10)
    version = VersionRoute(
        version="v1", framework="python", signature=Signature([], []), replicas=[]
    )
    table = RoutingTable(1, {"m": ModelRoute("m", "v1", {"v1": version})})
    router.routes = Routes(table, {}, None)
    if deployed is not None:
        router.holds.deployed = lambda model, version: deployed
    return DataPlane(router, request_timeout_s=30.0)


class Policy:
    """A caller's policy that records what it admitted (refusing all with ``refuse``)."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.admitted: list[tuple[Target, Any]] = []

    def authorize(self, model: str) -> None:
        raise AssertionError("resolve admits; it does not authorize by itself")

    async def charge(self, model: str) -> None:
        raise AssertionError("resolve admits; it does not charge by itself")

    async def admit(self, target: Any, graphs: Any) -> None:
        self.admitted.append((target, graphs))
        if self.refuse:
            raise Forbidden(f"may not use model {target.model!r}")


def _never() -> float:
    raise AssertionError("the timeout is read only when the table lacks the target")


def test_a_listed_target_is_admitted_with_the_planes_graphs() -> None:
    plane, policy = _plane(), Policy()
    target = asyncio.run(
        plane.resolve("m", None, started=time.perf_counter(), timeout_s=_never, policy=policy)
    )
    assert (target.model, target.version) == ("m", "v1")
    assert policy.admitted == [(target, plane.graphs)]
    assert asyncio.run(plane.resolve("m", "v1", started=time.perf_counter())) == target


@pytest.mark.parametrize("deployed", [None, False])
def test_an_unknown_model_is_404_before_the_policy_is_asked(deployed: bool | None) -> None:
    plane, policy, read = _plane(deployed), Policy(refuse=True), []

    def timeout_s() -> float:
        read.append(1)
        return 1.0

    with pytest.raises(ModelNotFound):
        asyncio.run(
            plane.resolve("nope", None, started=time.perf_counter(), timeout_s=timeout_s,
                          policy=policy)
        )  # fmt: skip
    assert policy.admitted == []  # a 404, not a 403
    assert read == [1]  # read once the table lacks it, as the routes read it before


def test_a_version_just_deployed_is_waited_for_within_the_requests_timeout() -> None:
    plane, started = _plane(deployed=True), time.perf_counter()
    with pytest.raises(ModelNotReady, match="deployed but not started yet"):
        asyncio.run(plane.resolve("m", "v2", started=started, timeout_s=lambda: 0.2))
    assert 0.15 < time.perf_counter() - started < 3  # its 0.2 s, not the server's 30 s


def test_the_policys_refusal_stands() -> None:
    with pytest.raises(Forbidden):
        asyncio.run(_plane().resolve("m", None, started=time.perf_counter(), policy=Policy(True)))
