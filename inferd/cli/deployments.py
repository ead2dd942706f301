"""Deployments from the command line: deploy, traffic, rollback, undeploy, deployments."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from inferd.registry.deployments import DeploymentRecord, TrafficRecord
from inferd.cli.common import (
    _ACTOR,
    _PICKED_UP,
    ConfigOpt,
    DataDirOpt,
    _errors,
    _registry,
    app,
    console,
)


def _split_text(split: dict[str, int]) -> str:
    return " ".join(f"{v}={pct}%" for v, pct in split.items()) or "-"


def _parse_split(items: list[str]) -> dict[str, int]:
    """``["v1=90", "v2=10"]`` -> ``{"v1": 90, "v2": 10}``; the registry checks the values."""
    split: dict[str, int] = {}
    for item in items:
        version, _, pct = item.rpartition("=")
        if not version or not pct.removeprefix("-").isdigit():
            raise typer.BadParameter(f"expected VERSION=PERCENT, e.g. v3.1=10, got {item!r}")
        split[version] = int(pct)
    return split


@app.command()
def deploy(
    model: Annotated[str, typer.Argument(help="Model name.")],
    version: Annotated[str, typer.Argument(help="A registered version.")],
    traffic: Annotated[
        int | None,
        typer.Option(
            help="Its percent of the traffic (default 100; canary: its first step; shadow: "
            "the percent of requests mirrored to it)."
        ),
    ] = None,
    replicas: Annotated[int | None, typer.Option(help="Replica processes.")] = None,
    gpu: Annotated[str | None, typer.Option(help="GPU type, e.g. A100.")] = None,
    strategy: Annotated[
        str, typer.Option(help="How to roll out: rolling, blue-green, canary or shadow.")
    ] = "rolling",
    keep_old_s: Annotated[
        float | None,
        typer.Option(
            help="blue-green, canary: seconds the replaced versions stay after the switch "
            "(default 300)."
        ),
    ] = None,
    steps: Annotated[
        str | None, typer.Option(help="canary: percents, e.g. 1,10,50,100 (the default).")
    ] = None,
    step_s: Annotated[
        float | None, typer.Option(help="canary: analysis window of each step (default 60).")
    ] = None,
    webhook: Annotated[
        str | None, typer.Option(help="canary: URL that must answer 2xx to each step's figures.")
    ] = None,
    rollout: Annotated[
        str | None,
        typer.Option(
            help="More strategy settings as JSON, e.g. '{\"max_latency_increase\": 0.2}'."
        ),
    ] = None,
    min_replicas: MinReplicasOpt = None,
    max_replicas: MaxReplicasOpt = None,
    autoscaling: AutoscalingOpt = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Deploy a registered version with TRAFFIC % of the model's requests; the other
    deployed versions share the rest in proportion. A canary moves through its steps on
    its own while its analysis passes, and rolls back when it does not. With
    --min-replicas/--max-replicas (or --autoscaling) its replica count follows its load."""
    settings = _rollout_settings(rollout, keep_old_s, steps, step_s, webhook)
    policy = _autoscaling(autoscaling, min_replicas, max_replicas)
    with _errors(), _registry(config, data_dir) as registry:
        registry.deployments.deploy(
            model,
            version,
            traffic_pct=traffic,
            replicas=replicas,
            gpu_type=gpu,
            strategy=strategy,
            rollout=settings or None,
            autoscaling=policy,
            actor=_ACTOR,
        )
        change = registry.deployments.history(model, 1)[0]
    console.print(
        f"deployed [bold]{model}:{version}[/bold] ({strategy}); traffic "
        f"{_split_text(change.split)} (revision {change.revision}); {_PICKED_UP}"
    )


MinReplicasOpt = Annotated[
    int | None, typer.Option(help="Autoscale: fewest replicas (0: scale to zero when idle).")
]
MaxReplicasOpt = Annotated[int | None, typer.Option(help="Autoscale: most replicas.")]
AutoscalingOpt = Annotated[
    str | None,
    typer.Option(
        help='Autoscaling policy as JSON, e.g. \'{"sla_p99_ms": 50, "idle_timeout_s": 600}\' '
        "(any field of the policy; the defaults are the design documents' table)."
    ),
]


def _autoscaling(
    raw: str | None, min_replicas: int | None, max_replicas: int | None
) -> dict[str, Any] | None:
    if raw is None and min_replicas is None and max_replicas is None:
        return None
    policy: dict[str, Any] = {}
    if raw is not None:
        try:
            policy = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise typer.BadParameter(f"--autoscaling is not JSON: {exc}") from None
        if not isinstance(policy, dict):
            raise typer.BadParameter("--autoscaling must be a JSON object")
    for key, value in (("min_replicas", min_replicas), ("max_replicas", max_replicas)):
        if value is not None:
            policy[key] = value
    return policy


@app.command()
def autoscale(
    model: Annotated[str, typer.Argument(help="Model name.")],
    version: Annotated[str, typer.Argument(help="A deployed version.")],
    min_replicas: MinReplicasOpt = None,
    max_replicas: MaxReplicasOpt = None,
    autoscaling: AutoscalingOpt = None,
    off: Annotated[bool, typer.Option("--off", help="Back to its fixed replica count.")] = False,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Give a deployment an autoscaling policy (or take it away with --off)."""
    policy = None if off else _autoscaling(autoscaling, min_replicas, max_replicas)
    if policy is None and not off:
        raise typer.BadParameter("give --min-replicas/--max-replicas, --autoscaling, or --off")
    with _errors(), _registry(config, data_dir) as registry:
        record = registry.deployments.set_autoscaling(model, version, policy)
    what = "a fixed replica count" if record.autoscaling is None else (
        f"autoscaling {record.autoscaling.min_replicas}..{record.autoscaling.max_replicas} replicas"
    )  # fmt: skip
    console.print(f"[bold]{model}:{version}[/bold]: {what}; {_PICKED_UP}")


def _rollout_settings(
    raw: str | None,
    keep_old_s: float | None,
    steps: str | None,
    step_s: float | None,
    webhook: str | None,
) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if raw is not None:
        try:
            settings = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise typer.BadParameter(f"--rollout is not JSON: {exc}") from None
        if not isinstance(settings, dict):
            raise typer.BadParameter("--rollout must be a JSON object")
    if steps is not None:
        try:
            settings["steps"] = [int(x) for x in steps.split(",")]
        except ValueError:
            message = f"--steps must be percents like 1,10,50,100: {steps!r}"
            raise typer.BadParameter(message) from None
    for key, value in (("keep_old_s", keep_old_s), ("step_s", step_s), ("webhook", webhook)):
        if value is not None:
            settings[key] = value
    return settings


@app.command("traffic")
def traffic_cmd(
    model: Annotated[str, typer.Argument(help="Model name.")],
    weights: Annotated[list[str], typer.Argument(help="VERSION=PERCENT ..., summing to 100.")],
    revision: Annotated[
        int | None, typer.Option(help="Refuse if the split changed since this revision.")
    ] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Set a model's traffic split; deployed versions left out get 0 %."""
    split = _parse_split(weights)
    with _errors(), _registry(config, data_dir) as registry:
        change = registry.deployments.set_traffic(model, split, actor=_ACTOR, revision=revision)
    console.print(
        f"[bold]{model}[/bold] traffic {_split_text(change.split)} "
        f"(revision {change.revision}); {_PICKED_UP}"
    )


@app.command()
def rollback(
    model: Annotated[str, typer.Argument(help="Model name.")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Back to the last stable split: one still-deployed version at 100 %."""
    with _errors(), _registry(config, data_dir) as registry:
        change = registry.deployments.rollback(model, actor=_ACTOR)
    console.print(
        f"[bold]{model}[/bold] rolled back ({change.detail}): traffic "
        f"{_split_text(change.split)} (revision {change.revision}); {_PICKED_UP}"
    )


@app.command()
def undeploy(
    model: Annotated[str, typer.Argument(help="Model name.")],
    version: Annotated[str, typer.Argument(help="A deployed version taking no traffic.")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Remove a deployment: it drains, then the server stops its replicas."""
    with _errors(), _registry(config, data_dir) as registry:
        registry.deployments.undeploy(model, version, actor=_ACTOR)
    console.print(f"[bold]{model}:{version}[/bold] draining; {_PICKED_UP}")


@app.command()
def deployments(
    model: Annotated[str | None, typer.Argument(help="One model, with its history.")] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Deployed versions with their status, replicas and traffic (models without
    deployments: automatic, their newest version takes all traffic)."""
    with _errors(), _registry(config, data_dir) as registry:
        records = [registry.get_model(model)] if model else registry.list_models()
        rows = registry.deployments.list_all(model)
        history = registry.deployments.history(model) if model else []
    table = Table("model", "version", "status", "replicas", "gpu", "traffic", "rollout")
    deployed = {r.model_name for r in rows}
    for r in rows:
        replicas = str(r.replicas) if r.replicas is not None else "default"
        if r.autoscaling is not None:
            replicas = f"auto {r.autoscaling.min_replicas}..{r.autoscaling.max_replicas}"
        table.add_row(
            r.model_name, r.version, r.status, replicas, r.gpu_type or "-", f"{r.traffic_pct}%",
            _rollout_text(r),
        )  # fmt: skip
    for m in records:
        if m.name not in deployed and m.versions:
            status, share = ("automatic", "100%") if m.loaded else ("unloaded", "-")
            table.add_row(m.name, m.versions[-1].version, status, "default", "-", share, "-")
    out = Console()
    out.print(table)
    if history:
        out.print(_history_table(history))


def _rollout_text(record: DeploymentRecord) -> str:
    """A deployment's strategy and where it stands, in a few words."""
    if (shadow := record.shadow) is not None:
        return f"shadow, mirrors {shadow.mirror_pct}%"
    if (canary := record.canary) is not None:
        text = f"canary {canary.state.value}, step {canary.step + 1}/{len(canary.steps)}"
        return f"{text}: {canary.reason}" if canary.reason else text
    if (blue_green := record.blue_green) is not None:
        return "blue-green, switched" if blue_green.switched_at else "blue-green, waiting"
    return record.strategy.value


def _history_table(history: list[TrafficRecord]) -> Table:
    table = Table("revision", "when (UTC)", "reason", "actor", "traffic", "detail", title="history")
    for h in history:
        when = h.created_at.strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            str(h.revision), when, h.reason, h.actor, _split_text(h.split), h.detail or ""
        )
    return table
