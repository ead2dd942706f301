"""The reference pages of the docs site (``docs/reference/``) are generated from the code by
``scripts/gen_reference.py``: committed ones must be what it generates now, and what they
list must be complete, checked here against the code by other means than the generator's
(the metrics against what the real writers of ``/metrics`` render)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import types
import typing
from collections.abc import Iterator

import typer.main
from pydantic import BaseModel

from inferd.config import Settings
from tests.conftest import ROOT

REFERENCE = ROOT / "docs" / "reference"


def page(name: str) -> str:
    return (REFERENCE / name).read_text(encoding="utf-8")


def test_the_committed_pages_are_what_the_code_generates() -> None:
    # Who generates them must change nothing: a page shows defaults, never a setting
    # (least of all a secret) from their environment, nor text wrapped to their terminal.
    env = {
        **os.environ,
        "INFERD_PORT": "1234",
        "INFERD_CLUSTER__TOKEN": "not-for-the-docs",
        "COLUMNS": "40",
        "PYTHONHASHSEED": "1",
    }
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_reference.py"), "--check"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "not-for-the-docs" not in page("settings.md")


def dotted_settings(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[str]:
    """Every setting's dotted name, groups and their fields included (a mapping of groups
    as ``<name>``, as the page names its entries)."""
    for name, info in model.model_fields.items():
        dotted = (*prefix, name)
        yield ".".join(dotted)
        annotation = info.annotation
        below = (*dotted, "<name>") if typing.get_origin(annotation) is dict else dotted
        for arg in (annotation, *typing.get_args(annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                yield from dotted_settings(arg, below)


def test_every_setting_is_listed_by_its_dotted_name() -> None:
    text = page("settings.md")
    names = list(dotted_settings(Settings))
    assert "batching.max_wait_ms" in names and "rate_limits.default.burst" in names
    missing = [name for name in names if f"`{name}`" not in text]
    assert not missing, missing
    assert "`INFERD_BATCHING__MAX_WAIT_MS`" in text


def sections(text: str) -> dict[str, str]:
    """``## `heading``` -> the text under it."""
    parts = re.split(r"^## `([^`]+)`$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_command_is_listed_with_its_options() -> None:
    from inferd.cli import app

    listed = sections(page("cli.md"))

    def walk(command: typing.Any, path: str) -> Iterator[tuple[str, typing.Any]]:
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            if not sub.hidden:
                yield from walk(sub, f"{path} {name}")

    commands = dict(walk(typer.main.get_command(app), "inferd"))
    assert {"inferd serve", "inferd models push", "inferd keys revoke"} <= set(commands)
    assert not set(commands) ^ set(listed), set(commands) ^ set(listed)
    for path, command in commands.items():
        for param in command.params:
            for option in param.opts:
                assert option in listed[path], (path, option)


def test_every_error_class_is_listed_with_its_status_and_code() -> None:
    from inferd.errors import InferdError

    for module in ("inferd.api.app", "inferd.server"):  # they load every module with an error
        importlib.import_module(module)

    rows = {
        m[1]: (int(m[2]), m[3])
        for m in re.finditer(
            r"^\| `(\w+)` \| `\w+` \| (\d+) \| `(\w+)` \|", page("errors.md"), re.M
        )
    }

    def walk(cls: type[InferdError]) -> Iterator[type[InferdError]]:
        yield cls
        for sub in cls.__subclasses__():
            yield from walk(sub)

    classes = {c.__name__: c for c in walk(InferdError) if c.__module__.startswith("inferd")}
    assert {"InferdError", "PromptTooLong", "ReplicaGone", "QueueUnavailable"} <= set(classes)
    assert set(classes) == set(rows), set(classes) ^ set(rows)
    for name, cls in classes.items():
        assert rows[name] == (cls.status_code, cls.code), name


def rendered_metrics() -> dict[str, tuple[str, set[str] | None]]:
    """Family -> (type, label names of its samples; None: no sample) of an exposition the
    real writers render from a little of everything, with the control plane's labels."""
    from inferd.control.scaling import ColdStarts
    from inferd.control.state import reachable
    from inferd.monitoring import exposition as x
    from inferd.shapes.logs import LogRow
    from inferd.shapes.replica import ReplicaState, ReplicaStats, Status
    from inferd.telemetry.metrics import Histogram

    requests = x.RequestMetrics()
    requests.observe([
        LogRow(request_id="r", model_name="m", version="1", api="v1", status_code=200,
               latency_ms=1.0, cache_hit=True, prompt_tokens=3, completion_tokens=4),
    ])  # fmt: skip
    replica = types.SimpleNamespace(id="r1", state=ReplicaState.READY, address="unix:/r1")
    models = {"m": types.SimpleNamespace(versions={"1": types.SimpleNamespace(replicas=[replica])})}
    [(labels, _)] = reachable(models)  # type: ignore[arg-type]
    snapshot = Histogram((1.0,)).snapshot()
    status = Status(
        id=1, state=ReplicaState.READY, pid=1, model="m", version="1",
        stats=ReplicaStats(**dict.fromkeys({**x.REPLICA_GAUGES, **x.REPLICA_COUNTERS}, 1.0)),
        metrics={**dict.fromkeys(x.REPLICA_HISTOGRAMS, snapshot), "shed": {"3": 1},
                 "finished": {"stop": 1}},
    )  # fmt: skip
    out = x.Text()
    x.write_requests(out, requests)
    x.write_replicas(out, [(labels, "ready", 0)], [(labels, status)])
    x.write_scaling(
        out, [("m", "1", 1, True)], {("m", "1", "queue"): 1}, {("m", "1"): ColdStarts()}
    )
    x.write_processes(out, [({"process": "server", "id": "server"}, os.getpid())])
    feedback = {"model": "m", "version": "1", "labelled": 1, "numeric": 1, "accuracy": 1.0,
                "mean_abs_error": 0.0}  # fmt: skip
    x.write_accuracy(out, [feedback], [({"model": "m", "version": "1"}, 0.9)])
    found: dict[str, tuple[str, set[str] | None]] = {}
    for line in out.render().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            found[name] = (kind, None)
        elif not line.startswith("#"):
            sample = line.partition("{")[0].partition(" ")[0]
            name = re.sub(r"_(bucket|sum|count)$", "", sample) if sample not in found else sample
            keys = set(re.findall(r'(\w+)="', line)) - {"le"}
            found[name] = (found[name][0], (found[name][1] or set()) | keys)
    return found


def test_every_metric_is_listed_with_its_type_and_labels() -> None:
    rows = {
        m[1]: (m[2], set(re.findall(r"`(\w+)`", m[3])))
        for m in re.finditer(r"^\| `(inferd_\w+)` \| (\w+) \| ([^|]*) \|", page("metrics.md"), re.M)
    }
    rendered = rendered_metrics()
    assert len(rendered) > 40
    for name, (kind, labels) in rendered.items():
        assert name in rows, name
        assert rows[name][0] == kind, name
        if labels is not None:
            assert rows[name][1] == labels, name
    # families declared where the writers above do not reach (the job service's)
    declared = set()
    for path in (ROOT / "inferd").rglob("*.py"):
        declared |= set(re.findall(r'\.family\(\s*"(inferd_\w+)"', path.read_text()))
    assert "inferd_jobs" in declared
    assert declared <= set(rows), declared - set(rows)
