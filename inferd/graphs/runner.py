"""Running a graph in the gateway, over the data plane.

A graph version has no replica: the gateway that received the request walks the graph
and sends each model node through :meth:`DataPlane.infer`, so every node gets what a
request to that model gets (its traffic split, batching in its replicas, the result
cache, holds for a replica that is starting) and the graph adds only its own row
arithmetic (:mod:`inferd.graphs.rows`) on the event loop. Model code never runs here:
a "small Python step" is a registered Python model, a node like any other.

Each node call is an inference-log row (``api`` ``graph``) under the graph request's
id and, while tracing is on, a span; a node's failure names it and keeps its status.

Who may call what: a graph never widens what a caller reaches. Before any node runs, the
caller's policy (``InferRequest.policy``) must allow every model the graph can reach
(its model nodes, through nested graphs: :meth:`Graphs.reach`), or the request fails
403 naming the first it may not use; each node call takes the request from its model's
rate limit (once a request per model). KServe's InferenceGraph and Seldon's pipelines
call their steps as the router's own identity; here the caller's credential is what
each step is checked against, so a key limited to a graph is also listed for its
models.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from inferd.errors import InferdError, InvalidInput, ModelError
from inferd.graphs import rows as r
from inferd.shapes.graph import Graph, GraphSpecError, Node, parse
from inferd.shapes.logs import LogRow
from inferd.shapes.replica import Columns, InferRequest
from inferd.telemetry import tracing

if TYPE_CHECKING:
    from inferd.routing.dataplane import DataPlane, InferOutcome
    from inferd.routing.targets import Target


MAX_DEPTH = 8
"""Graphs a request may go through nested (a node of a graph may be a graph)."""
_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("inferd_graph_depth", default=0)


@dataclass(slots=True)
class Scope:
    """What a node sees: the request's columns and the current ones (a sequence's
    previous outputs over them) for ``rows`` rows, and the outputs of the nodes already
    computed on those rows."""

    request: Columns
    current: Columns
    rows: int
    done: dict[str, Columns] = field(default_factory=dict)

    def subset(self, index: np.ndarray) -> Scope:
        done = {name: r.take(out, index) for name, out in self.done.items()}
        return Scope(r.take(self.request, index), r.take(self.current, index), len(index), done)

    def source(self, source: str) -> np.ndarray:
        node, _, output = source.partition(".")
        columns = self.request if node == "request" else self.done.get(node, {})
        if output not in columns:
            raise InvalidInput(f"{source} is not available here (compute {node!r} first)")
        return columns[output]


class GraphRun:
    """One request through one graph version."""

    def __init__(
        self,
        plane: DataPlane,
        target: Target,
        graph: Graph,
        request: InferRequest,
        log: Callable[[LogRow], None] | None,
    ) -> None:
        self.plane, self.target, self.graph, self.request = plane, target, graph, request
        self.log = log

    async def node(self, name: str, scope: Scope) -> Columns:
        if name in scope.done:  # a node runs once per row: a switch's default reuses it
            return scope.done[name]
        node = self.graph.nodes[name]
        if node.kind == "model":
            out = await self.model(node, scope)
        elif node.kind == "sequence":
            out = await self.sequence(node, scope)
        elif node.kind == "switch":
            out = await self.switch(node, scope)
        elif node.kind == "ensemble":
            outs = await asyncio.gather(*(self.node(c, scope) for c in node.children))
            try:
                out = {node.output: r.combine([o[node.output] for o in outs], node.combine)}
            except (KeyError, ValueError) as exc:
                raise self.failed(node, InvalidInput(f"cannot combine: {exc}")) from None
        else:
            seed = f"{self.request.request_id}\0{name}" if self.request.request_id else None
            chosen = random.Random(seed).choices(node.children, node.weights)[0]
            out = await self.node(chosen, scope)
        scope.done[name] = out
        return out

    async def sequence(self, node: Node, scope: Scope) -> Columns:
        # Its own current columns (an ensemble may run several sequences at once); the
        # outputs computed are shared, so later nodes may read them.
        inner = Scope(scope.request, dict(scope.current), scope.rows, scope.done)
        out: Columns = {}
        for step in node.children:
            out = await self.node(step, inner)
            inner.current = {**inner.current, **out}
        return out

    async def sources(self, sources: list[str], scope: Scope) -> None:
        """Compute the nodes ``sources`` read (``NODE.OUTPUT``), before reading them."""
        for source in sources:
            name = source.partition(".")[0]
            if name != "request":
                await self.node(name, scope)

    async def switch(self, node: Node, scope: Scope) -> Columns:
        await self.sources([c.source for c in node.conditions], scope)
        try:
            masks = [r.holds(c, scope.source(c.source)) for c in node.conditions]
        except ValueError as exc:
            raise self.failed(node, InvalidInput(str(exc))) from None
        except InferdError as exc:
            raise self.failed(node, exc) from None
        branch = r.branch_of(masks, scope.rows)
        assert node.default is not None
        names = (*node.children, node.default)
        taken = [(name, np.flatnonzero(branch == i)) for i, name in enumerate(names)]
        taken = [(name, index) for name, index in taken if len(index)]
        outs = await asyncio.gather(*(self.node(n, scope.subset(i)) for n, i in taken))
        parts = [index for _, index in taken]
        try:
            return r.merge(list(zip(parts, outs, strict=True)), scope.rows)
        except ValueError as exc:
            raise self.failed(node, InvalidInput(str(exc))) from None

    async def model(self, node: Node, scope: Scope) -> Columns:
        plane, began = self.plane, time.perf_counter()
        described = f"model {node.model}" + (f":{node.version}" if node.version else "")
        await self.sources([source for _, source in node.inputs], scope)
        try:
            ask = self.request
            target = await plane.resolve(
                node.model, node.version, started=ask.started, timeout_s=ask.timeout_s
            )  # charged below, once its inputs are found (every model authorized first)
            inputs = _inputs(node, target, scope)
            if ask.policy is not None:
                await ask.policy.charge(target.model)
            request = plane.request(
                ask.request_id, ask.started, ask.timeout_s, ask.priority,
                pinned=node.version is not None, policy=ask.policy,
            )  # fmt: skip
            outcome = await self._traced(node, target, inputs, scope.rows, request)
        except InferdError as exc:
            self._log(node.model, node.version, getattr(exc, "status_code", 500), began)
            raise self.failed(node, exc, described) from None
        except Exception as exc:  # a bug here is still the node's: say which
            self._log(node.model, node.version, 500, began)
            raise self.failed(node, ModelError(str(exc)), described) from exc
        self._log(node.model, outcome.target.version, 200, began, outcome)
        return outcome.outputs

    async def _traced(
        self, node: Node, target: Target, inputs: Columns, rows: int, request: InferRequest
    ) -> InferOutcome:
        if tracing.tracer is None:
            return await self.plane.infer(target, inputs, rows, request)
        attributes = {"inferd.graph": self.target.model, "inferd.node": node.name,
                      "inferd.model": target.model, "inferd.version": target.version}  # fmt: skip
        with tracing.tracer.start_as_current_span(
            f"inferd.graph node {node.name}", attributes=attributes
        ):
            return await self.plane.infer(target, inputs, rows, request)

    def failed(self, node: Node, exc: InferdError, described: str = "") -> InferdError:
        """``exc`` (its class and status kept) with a message naming the node."""
        where = f"node {node.name!r}" + (f" ({described})" if described else "")
        message = f"graph {self.target.model}: {where}: {exc.message}"
        named = type(exc).__new__(type(exc), message)  # not __init__: its own arguments vary
        named.__dict__.update(exc.__dict__)
        named.message = message
        named.details = {**exc.details, "node": node.name}
        return named

    def _log(
        self,
        model: str,
        version: str | None,
        status: int,
        began: float,
        outcome: InferOutcome | None = None,
    ) -> None:
        if self.log is None:
            return
        from inferd.routing.context import RequestContext  # it imports the data plane

        ms = (time.perf_counter() - began) * 1000
        context = RequestContext(request_id=self.request.request_id, outcome=outcome)
        self.log(context.log_row("graph", model, status, ms, version))


def _inputs(node: Node, target: Target, scope: Scope) -> Columns:
    """A model node's columns: its ``inputs`` mapping, else the current columns its
    signature names."""
    if node.inputs:
        return {name: scope.source(source) for name, source in node.inputs}
    wanted = [spec.name for spec in target.signature.inputs]
    missing = [n for n in wanted if n not in scope.current]
    if missing:
        raise InvalidInput(f"no column for its input(s) {missing}")
    return {n: scope.current[n] for n in wanted}


class Graphs:
    """The graph versions a gateway runs, parsed once per version (and artifact)."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.log: Callable[[LogRow], None] | None = None
        """Where node calls are logged (the gateway's inference log); None: not logged."""
        self._parsed: dict[tuple[str, str, str], Graph] = {}

    def graph(self, target: Target) -> Graph:
        return self.spec(target.model, target.version)

    def spec(self, model: str, version: str) -> Graph:
        """Graph ``model:version`` as the routing table holds it, parsed."""
        route = self.plane.router.version_route(model, version)
        if route is None or route.graph is None:
            raise ModelError(f"graph {model}:{version} has no spec in the table")
        key = (model, version, route.digest)
        graph = self._parsed.get(key)
        if graph is None:
            try:
                graph = self._parsed[key] = parse(route.graph)
            except GraphSpecError as exc:  # checked at push: only a corrupt table
                raise ModelError(f"graph {model}:{version}: {exc}") from None
        return graph

    def reach(self, target: Target) -> frozenset[str]:
        """The models a graph version can call: its model nodes', and those of the
        graphs among them (every graph version the routing table lists for a node's
        model, or the one it pins), as deep as graphs may nest."""
        seen: set[tuple[str, str]] = set()
        models: set[str] = set()
        todo = [(target.model, target.version, 0)]
        while todo:
            model, version, depth = todo.pop()
            if (model, version) in seen or depth >= MAX_DEPTH:
                continue
            seen.add((model, version))
            for name, pinned in self.spec(model, version).models():
                models.add(name)
                route = self.plane.router.table.models.get(name)
                for v, inner in route.versions.items() if route else ():
                    if inner.graph is not None and pinned in (None, v):
                        todo.append((name, v, depth + 1))
        return frozenset(models)

    async def run(
        self, target: Target, inputs: Columns, rows: int, request: InferRequest
    ) -> InferOutcome:
        from inferd.routing.dataplane import InferOutcome

        graph = self.graph(target)
        depth = _DEPTH.get()
        if depth >= MAX_DEPTH:  # graphs may call graphs: a loop of them must end
            raise InvalidInput(f"graphs nest deeper than {MAX_DEPTH} (a graph calling itself?)")
        if request.policy is not None and depth == 0:
            for model in sorted(self.reach(target)):
                request.policy.authorize(model)
        token = _DEPTH.set(depth + 1)
        try:
            run = GraphRun(self.plane, target, graph, request, self.log)
            out = await run.node(graph.root, Scope(inputs, inputs, rows))
        finally:
            _DEPTH.reset(token)
        if graph.outputs is not None:
            out = {name: out[name] for name in graph.outputs if name in out}
        elapsed = (time.perf_counter() - request.started) * 1000
        return InferOutcome(target, out, elapsed)
