"""A request's policy: its caller against each model it reaches, whichever transport it
came by (the :class:`~inferd.shapes.replica.ModelPolicy` the data plane and the graph
runner are given).

HTTP makes one for a request (:func:`inferd.api.policy.policy_of`), gRPC for a call
(``InferenceService._policy`` in :mod:`inferd.grpc.service`), and
:meth:`~inferd.routing.dataplane.DataPlane.resolve` or the route admits each target
with it; either way the models whose rate limit the request already took (the path's,
by the gate; the call's) are not charged again. It rides in the request's
:class:`~inferd.shapes.replica.InferRequest` so that a graph's node calls are charged
to their models' limits as they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferd.shapes.graph import GRAPH_FRAMEWORK

if TYPE_CHECKING:
    from inferd.access.limits import RateLimits
    from inferd.access.principal import Principal
    from inferd.shapes.replica import Reaches, TargetT


class RequestPolicy:
    """One request's caller against the models it reaches (a
    :class:`~inferd.shapes.replica.ModelPolicy`)."""

    __slots__ = ("charged", "limits", "principal", "who")

    def __init__(
        self, principal: Principal | None, limits: RateLimits | None, who: str, charged: set[str]
    ) -> None:
        self.principal = principal
        self.limits = limits
        self.who = who
        self.charged = charged
        """The models whose rate limit this request has taken (the path's, by the gate)."""

    def authorize(self, model: str) -> None:
        if self.principal is not None:
            self.principal.allow_model(model)

    async def charge(self, model: str) -> None:
        base = model.partition(":")[0]
        if self.limits is None or base in self.charged:
            return
        self.charged.add(base)
        await self.limits.take_model(self.who, base)

    async def admit(self, target: TargetT, graphs: Reaches[TargetT]) -> None:
        """The caller may reach ``target`` (a graph: and every model it can reach), and
        ``target``'s rate limit is taken; raises the 403 or 429."""
        self.authorize(target.model)
        if target.framework == GRAPH_FRAMEWORK:
            for model in sorted(graphs.reach(target)):
                self.authorize(model)
        await self.charge(target.model)
