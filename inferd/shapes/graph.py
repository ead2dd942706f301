"""A graph's spec (``graph.json``): parsed and checked once, at push and in the gateway.

A graph is a model version whose framework is ``graph``, so registering, versions,
deployments, traffic splits and rollbacks apply to it unchanged. Its folder holds
``graph.json``::

    {"root": "route",
     "nodes": {
       "screen": {"model": "fraud-fast"},
       "score":  {"model": "fraud", "version": "v1"},
       "route":  {"switch": [{"when": {"source": "screen.probabilities", "index": 1,
                                       "between": [0.2, 0.8]},
                              "then": "score"}],
                  "default": "screen"}},
     "outputs": ["label", "probabilities"]}

Node kinds (exactly one key of each node names its kind):

- ``model``: a registered model (``version``: pinned; else its traffic split), fed the
  current columns (the request's, or the previous step's outputs over them) or, with
  ``inputs``, ``{"its input": "SOURCE"}``;
- ``sequence``: nodes in order, each step's outputs over the columns the next one sees;
- ``switch``: per row, the first case whose ``when`` holds sends the row to ``then``,
  the others go to ``default``; answers are merged back in row order;
- ``ensemble``: nodes run at once, their ``output`` combined by ``combine`` (mean, max,
  vote) per row;
- ``split``: one node per request, by weight (``{"a": 90, "b": 10}``), drawn from the
  request id.

A SOURCE is ``request.NAME`` (a request input) or ``NODE.OUTPUT`` (an output of a node
computed before, on the same rows: a node runs at most once per row of a request). A
condition is ``{"source", "index"?, OP: value}`` with OP one of ``between`` ([low,
high], inclusive), ``gt``, ``ge``, ``lt``, ``le``, ``eq``, ``ne``, ``in``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inferd.shapes.tensors import Signature, TensorSpec

GRAPH_FRAMEWORK = "graph"
SPEC_FILE = "graph.json"
KINDS = ("model", "sequence", "switch", "ensemble", "split")
OPS = ("between", "gt", "ge", "lt", "le", "eq", "ne", "in")
COMBINERS = ("mean", "max", "vote")


class GraphSpecError(ValueError):
    """The spec is not a valid graph; the message says where."""


@dataclass(frozen=True, slots=True)
class Condition:
    source: str
    op: str
    value: Any
    index: int | None = None


@dataclass(frozen=True, slots=True)
class Node:
    """One node; ``kind`` says which of the other fields mean something."""

    name: str
    kind: str
    model: str = ""
    version: str | None = None
    inputs: tuple[tuple[str, str], ...] = ()
    """model: (its input name, SOURCE) pairs; empty: the current columns."""
    children: tuple[str, ...] = ()
    """sequence: its steps; switch: each case's node; ensemble and split: the members."""
    conditions: tuple[Condition, ...] = ()
    """switch: the condition of each case, in ``children``'s order."""
    default: str | None = None
    combine: str = "mean"
    output: str = ""
    weights: tuple[float, ...] = ()

    def needs(self) -> tuple[str, ...]:
        """The nodes this one calls or reads."""
        read = [c.source for c in self.conditions] + [s for _, s in self.inputs]
        sources = tuple(s.split(".", 1)[0] for s in read if not s.startswith("request."))
        return self.children + ((self.default,) if self.default else ()) + sources


@dataclass(frozen=True, slots=True)
class Graph:
    root: str
    nodes: dict[str, Node]
    outputs: tuple[str, ...] | None = None
    """The outputs the graph answers with (None: all of its root's)."""

    def models(self) -> list[tuple[str, str | None]]:
        """(model, pinned version) of every model node."""
        return [(n.model, n.version) for n in self.nodes.values() if n.kind == "model"]


def parse(spec: Any) -> Graph:
    """The graph ``spec`` describes; :class:`GraphSpecError` naming the first problem."""
    if not isinstance(spec, dict) or not isinstance(spec.get("nodes"), dict):
        raise GraphSpecError("a graph spec is an object with 'root' and 'nodes'")
    nodes = {str(name): _node(str(name), body) for name, body in spec["nodes"].items()}
    root = spec.get("root")
    if not isinstance(root, str) or root not in nodes:
        raise GraphSpecError(f"root {root!r} is not one of the nodes")
    for node in nodes.values():
        unknown = [n for n in node.needs() if n not in nodes and n != "request"]
        if unknown:
            raise GraphSpecError(f"node {node.name!r} refers to unknown node(s) {unknown}")
    _refuse_cycles(nodes)
    outputs = spec.get("outputs")
    if outputs is not None and not (
        isinstance(outputs, list) and outputs and all(isinstance(o, str) for o in outputs)
    ):
        raise GraphSpecError("'outputs' must be a list of output names")
    return Graph(root, nodes, tuple(outputs) if outputs else None)


def _node(name: str, body: Any) -> Node:
    kinds = [k for k in KINDS if isinstance(body, dict) and k in body]
    if len(kinds) != 1:
        raise GraphSpecError(f"node {name!r} must have exactly one of {', '.join(KINDS)}")
    kind = kinds[0]
    value = body[kind]
    if kind == "model":
        if not isinstance(value, str) or not value:
            raise GraphSpecError(f"node {name!r}: 'model' must be a model name")
        inputs = body.get("inputs") or {}
        if not isinstance(inputs, dict) or not all(
            isinstance(s, str) and _is_source(s) for s in inputs.values()
        ):
            raise GraphSpecError(
                f"node {name!r}: 'inputs' maps input names to 'request.NAME' or 'NODE.OUTPUT'"
            )
        version = body.get("version")
        if version is not None and not isinstance(version, str):
            raise GraphSpecError(f"node {name!r}: 'version' must be a string")
        return Node(name, kind, model=value, version=version, inputs=tuple(inputs.items()))
    if kind == "switch":
        return _switch(name, value, body.get("default"))
    if kind == "split":
        if not isinstance(value, dict) or not value or not all(
            isinstance(w, int | float) and w >= 0 for w in value.values()
        ) or sum(value.values()) <= 0:  # fmt: skip
            raise GraphSpecError(f"node {name!r}: 'split' maps nodes to weights (>= 0, some > 0)")
        return Node(name, kind, children=tuple(value), weights=tuple(map(float, value.values())))
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise GraphSpecError(f"node {name!r}: {kind!r} must be a list of node names")
    if kind == "sequence":
        return Node(name, kind, children=tuple(value))
    combine, output = body.get("combine", "mean"), body.get("output")
    if combine not in COMBINERS or not isinstance(output, str):
        raise GraphSpecError(
            f"node {name!r}: an ensemble needs 'output' (a name) and 'combine' "
            f"({', '.join(COMBINERS)})"
        )
    return Node(name, kind, children=tuple(value), combine=combine, output=output)


def _switch(name: str, cases: Any, default: Any) -> Node:
    if not isinstance(cases, list) or not cases:
        raise GraphSpecError(f"node {name!r}: 'switch' must be a list of cases")
    if not isinstance(default, str):
        raise GraphSpecError(f"node {name!r}: a switch needs a 'default' node")
    children, conditions = [], []
    for i, case in enumerate(cases):
        if not isinstance(case, dict) or not isinstance(case.get("then"), str):
            raise GraphSpecError(f"node {name!r}: case {i} needs 'when' and 'then'")
        children.append(case["then"])
        conditions.append(_condition(f"node {name!r}: case {i}", case.get("when")))
    return Node(
        name, "switch", children=tuple(children), conditions=tuple(conditions), default=default
    )


def _condition(where: str, when: Any) -> Condition:
    if not isinstance(when, dict) or not _is_source(when.get("source")):
        raise GraphSpecError(f"{where}: 'when' needs a 'source' ('request.NAME' or 'NODE.OUTPUT')")
    ops = [op for op in OPS if op in when]
    if len(ops) != 1:
        raise GraphSpecError(f"{where}: 'when' needs exactly one of {', '.join(OPS)}")
    op, value = ops[0], when[ops[0]]
    if op == "between" and not (isinstance(value, list) and len(value) == 2):
        raise GraphSpecError(f"{where}: 'between' takes [low, high]")
    if op == "in" and not isinstance(value, list):
        raise GraphSpecError(f"{where}: 'in' takes a list")
    index = when.get("index")
    if index is not None and (not isinstance(index, int) or isinstance(index, bool)):
        raise GraphSpecError(f"{where}: 'index' must be an integer")
    return Condition(when["source"], op, value, index)


def _is_source(source: Any) -> bool:
    return isinstance(source, str) and all(source.partition(".")[::2])


def _refuse_cycles(nodes: dict[str, Node]) -> None:
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise GraphSpecError(f"the graph has a cycle: {' -> '.join((*path, name))}")
        if name in done or name not in nodes:
            return
        for child in nodes[name].needs():
            visit(child, (*path, name))
        done.add(name)

    for name in nodes:
        visit(name, ())


def first_model(graph: Graph, name: str | None = None) -> Node:
    """The model node a request reaches first: the graph's inputs are its inputs."""
    node = graph.nodes[name or graph.root]
    while node.kind != "model":
        # a switch computes the nodes its conditions read before any branch
        read = [c.source.split(".", 1)[0] for c in node.conditions]
        first = next((n for n in read if n != "request"), node.children[0])
        node = graph.nodes[first]
    return node


def signature_of(graph: Graph, signatures: dict[str, Signature]) -> Signature:
    """The graph's signature from its models' (``signatures``: model node name -> the
    signature of the version it calls): the inputs of the first model a request reaches,
    the outputs of what its root answers (an ensemble: its combined output)."""
    inputs = signatures[first_model(graph).name].inputs
    outputs = _outputs(graph, graph.root, signatures)
    if graph.outputs is not None:
        missing = [o for o in graph.outputs if o not in {s.name for s in outputs}]
        if missing:
            raise GraphSpecError(f"'outputs' names {missing}, which the root does not answer")
        outputs = tuple(s for s in outputs if s.name in graph.outputs)
    labels = signatures[first_model(graph).name].labels
    return Signature(inputs, outputs, labels)


def _outputs(graph: Graph, name: str, sigs: dict[str, Signature]) -> tuple[TensorSpec, ...]:
    node = graph.nodes[name]
    if node.kind == "model":
        return sigs[name].outputs
    if node.kind == "sequence":
        return _outputs(graph, node.children[-1], sigs)
    if node.kind == "switch":
        assert node.default is not None
        return _outputs(graph, node.default, sigs)
    first = _outputs(graph, node.children[0], sigs)
    if node.kind == "split":
        return first
    found = [s for s in first if s.name == node.output]
    if not found:
        raise GraphSpecError(f"node {name!r}: its members do not answer {node.output!r}")
    return (found[0],)
