"""The import structure stays layered, read from the source (nothing imported but
``inferd.shapes``): no package cycle at load time, nothing in the low layers imports the
layers above them, and what crosses processes in ``shapes/`` is typed.

The low layers are what a replica process runs (``serving/``, ``llm/``, ``runtimes/``)
and the leaves everyone imports (``shapes/``, ``telemetry/``); the high ones are the
gateway's and the server's (``access/``, ``routing/``, ``graphs/``, ``api/``, ``grpc/``,
``control/``, ``monitoring/``, ``cli/``, ``server``). What the two transports share
(``access/``) imports neither of them nor a web framework. ``docs/architecture.md``
states the same rule.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import typing
from collections import defaultdict
from pathlib import Path

import msgspec

import inferd.shapes

PACKAGE = Path(__file__).resolve().parent.parent / "inferd"
LOW = {"serving", "llm", "runtimes", "shapes", "telemetry"}
HIGH = {
    "access", "routing", "graphs", "api", "grpc", "control", "monitoring", "cli", "server", "jobs",
}  # fmt: skip
LEAVES = {
    "inferd", "shapes", "telemetry", "errors", "clock", "priority", "config", "replica_config",
}  # fmt: skip
"""Import nothing of inferd but each other (and ``inferd`` itself, for its version: the
package's root is the public facade, so it is no leaf of its own)."""

JSON_FIELDS = {
    ("VersionRoute", "graph"): "an inference graph's spec as its author wrote it (parsed "
    "into shapes.graph.Graph by the gateway that runs it)",
    ("SamplingParams", "guide"): "a JSON schema, a regex or a grammar: the client's JSON",
    ("GenerateRequest", "prompt"): "an OpenAI chat (messages, tools): the client's JSON",
    ("Generate", "prompt"): "an OpenAI chat (messages, tools): the client's JSON",
    ("Tensor", "data"): "a JSON tensor's elements (numbers, strings, booleans) when not bytes",
    ("Status", "metrics"): "the replica's histogram and counter snapshots "
    "(telemetry.metrics.Histogram.snapshot), rendered as they are for /metrics",
    ("ReplicaSpec", "metadata"): "a version's metadata as pushed: the user's JSON",
}
"""Fields of the ``shapes`` Structs that carry JSON as a client or an author gave it, the
only ones allowed an ``Any`` inside (never an ``Any`` field outright)."""


def _modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
        if "_pb2" not in p.name
    }


MODULES = _modules()


def _owner(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports() -> list[tuple[str, str, str]]:
    """(importer, imported module, kind): kind ``load`` at module level outside
    ``TYPE_CHECKING``, ``func`` inside a function, ``type`` under ``TYPE_CHECKING``."""
    edges: list[tuple[str, str, str]] = []

    def walk(module: str, node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            k = kind
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                k = "func"
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                k = "type"
            names: list[str] = []
            if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("inferd"):
                names = [f"{child.module}.{alias.name}" for alias in child.names]
            elif isinstance(child, ast.Import):
                names = [a.name for a in child.names if a.name.startswith("inferd")]
            for name in names:
                target = _owner(name)
                if target and target != module:
                    edges.append((module, target, k))
            walk(module, child, k)

    for module, path in MODULES.items():
        walk(module, ast.parse(path.read_text()), "load")
    return edges


EDGES = _imports()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_package_imports_another_that_imports_it_back_at_load_time() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target, kind in EDGES:
        if kind == "load" and _package(source) != _package(target):
            graph[_package(source)].add(_package(target))
            graph[_package(target)]
    assert _cycles(graph) == []


def test_the_low_layers_import_nothing_above_them() -> None:
    upward = sorted(
        f"{source} -> {target} ({kind})"
        for source, target, kind in EDGES
        if _package(source) in LOW and _package(target) in HIGH
    )
    assert upward == []


def test_the_leaves_import_only_leaves() -> None:
    outside = sorted(
        f"{source} -> {target}"
        for source, target, _ in EDGES
        if _package(source) in LEAVES - {"inferd"} and _package(target) not in LEAVES
    )
    assert outside == []


ACCESS_NEVER_IMPORTS = {"api", "grpc", "routing", "graphs"}
"""The transports ``access/`` serves, and the data plane above it (``routing/`` names
its types)."""
WEB = {"starlette", "fastapi", "uvicorn", "grpc", "h2", "httptools"}
"""Web frameworks and servers, and grpcio: what a transport-free module never imports."""


def test_access_imports_no_transport() -> None:
    inferd_imports = sorted(
        f"{source} -> {target} ({kind})"
        for source, target, kind in EDGES
        if _package(source) == "access" and _package(target) in ACCESS_NEVER_IMPORTS
    )
    assert inferd_imports == []
    web = []
    for module, path in MODULES.items():
        if _package(module) != "access":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            web += [f"{module} -> {n}" for n in names if n.split(".")[0] in WEB]
    assert web == []


def test_the_checker_sees_a_cycle_and_an_upward_import() -> None:
    """The two checks above would fail on what they look for."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert ("inferd.api.app", "inferd.routing.dataplane", "load") in EDGES
    assert any(kind == "func" for _, _, kind in EDGES)


def _structs() -> list[type[msgspec.Struct]]:
    found = []
    for info in pkgutil.iter_modules(inferd.shapes.__path__):
        module = importlib.import_module(f"inferd.shapes.{info.name}")
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, msgspec.Struct)
                and obj.__module__ == module.__name__
            ):
                found.append(obj)
    return found


def _has_any(hint: object) -> bool:
    return hint is typing.Any or any(_has_any(arg) for arg in typing.get_args(hint))


def test_no_struct_in_shapes_has_an_untyped_field() -> None:
    structs = _structs()
    assert len(structs) > 40
    untyped, loose = [], []
    for struct in structs:
        hints = typing.get_type_hints(struct)
        for field in struct.__struct_fields__:
            hint = hints[field]
            if hint is typing.Any or hint is dict or hint is list:
                untyped.append(f"{struct.__name__}.{field}")
            elif _has_any(hint) and (struct.__name__, field) not in JSON_FIELDS:
                loose.append(f"{struct.__name__}.{field}: {hint}")
    assert untyped == []
    assert loose == []


def test_the_json_fields_named_are_there() -> None:
    """A field leaving the list of JSON fields (typed at last, or gone) leaves it here."""
    fields = {
        (struct.__name__, field): typing.get_type_hints(struct)[field]
        for struct in _structs()
        for field in struct.__struct_fields__
    }
    assert all(_has_any(fields[key]) for key in JSON_FIELDS), sorted(
        key for key in JSON_FIELDS if key not in fields or not _has_any(fields[key])
    )
