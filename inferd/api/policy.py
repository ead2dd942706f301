"""One policy on every door: the per-model checks a request passes for each model it
reaches, whichever route it came by.

A model named in the path (``/api/v1/models/{m}/...``, ``/v2/models/{m}/...``) is
checked by the gates in front of every route: :class:`~inferd.api.auth.AuthGate` (the
caller may use it) and :class:`~inferd.api.limits.RateLimitGate` (its rate limit). The
rest is the request's :class:`~inferd.access.policy.RequestPolicy` (:func:`policy_of`),
which every handler has admit its target once it knows it (given to
:meth:`DataPlane.resolve <inferd.routing.dataplane.DataPlane.resolve>`, or by
:func:`admit`): a model named in the body (OpenAI, ``/api/v1/predict``, embeddings,
rerank and score, KServe V1, asynchronous requests, batch jobs, OpenAI batches), a graph
and every model the graph can reach (:meth:`inferd.graphs.runner.Graphs.reach`), each
model's rate limit taken once a request. The policy rides in the request's
:class:`~inferd.shapes.replica.InferRequest` so that a graph's node calls are charged
to their models' limits as they run.

Batch jobs and OpenAI batches are admitted when submitted (their items then run as the
server's job runner, at the ``batch`` priority): a submission takes one request from the
model's limit, not one per item; quotas per tenant are what bound their volume.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request

from inferd.access.policy import RequestPolicy
from inferd.api.auth import internal_caller
from inferd.api.http import context_of
from inferd.api.limits import http_client
from inferd.api.state import gateway_of

if TYPE_CHECKING:
    from inferd.routing.targets import Target


def policy_of(request: Request) -> RequestPolicy | None:
    """The request's policy; None when nothing applies (auth off, no per-model limit)."""
    context = context_of(request.scope)
    state = gateway_of(request)
    limits = state.limits
    token = state.settings.auth.internal_token
    if limits is not None and (not limits.config.models or internal_caller(request.scope, token)):
        limits = None  # the job runner's requests were charged when their job was submitted
    if context.principal is None and limits is None:
        return None
    charged = {context.limited} if context.limited else set()
    return RequestPolicy(context.principal, limits, http_client(request.scope), charged)


async def admit(request: Request, target: Target) -> RequestPolicy | None:
    """Whether the request's caller may reach ``target`` (and, for a graph, every model
    the graph can reach), with ``target``'s rate limit taken; raises the 403 or 429.
    The policy returned goes in the request's ``InferRequest``."""
    policy = policy_of(request)
    if policy is not None:
        await policy.admit(target, gateway_of(request).dataplane.graphs)
    return policy
