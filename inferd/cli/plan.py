"""``inferd plan gpus``: pack model replicas onto GPUs (see :mod:`inferd.control.gpu_plan`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from inferd.cli.common import ConfigOpt, DataDirOpt, _registry, app, console

plan_app = typer.Typer(help="Capacity planning.", no_args_is_help=True)
app.add_typer(plan_app, name="plan")


@plan_app.command("gpus")
def plan_gpus(
    file: Annotated[
        Path | None,
        typer.Option(
            "--file",
            exists=True,
            help="YAML with models (name, memory_gb, replicas, latency), gpus (type, "
            "memory_gb, count) and optional rules (headroom, heavy_gb, critical_heavy_gb).",
        ),
    ] = None,
    gpus: Annotated[
        str | None,
        typer.Option(help="GPU inventory, e.g. A100-80GB:80:16,L4:24:4 (overrides the file's)."),
    ] = None,
    headroom: Annotated[float | None, typer.Option(help="Share of each GPU left free.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Place every replica on the fewest GPUs: memory with headroom, one replica of a
    model per GPU, latency-critical models kept from heavy neighbours. Models come from
    --file, or from the registry (versions with metadata gpu_memory_gb; latency_class
    and the deployment's replicas when set). Prints the lower bound beside the plan."""
    from inferd.control.gpu_plan import GpuType, ModelNeed, Rules, parse_inventory, plan, rows

    spec: dict[str, Any] = {}
    if file is not None:
        import yaml

        spec = yaml.safe_load(file.read_text()) or {}
    try:
        if "models" in spec:
            models = [ModelNeed(**m) for m in spec["models"]]
        else:
            models = _from_registry(config, data_dir)
        inventory = parse_inventory(gpus) if gpus else [GpuType(**g) for g in spec.get("gpus", [])]
        rules = Rules(**spec.get("rules", {}))
        if headroom is not None:
            rules = Rules(headroom, rules.heavy_gb, rules.critical_heavy_gb)
    except (TypeError, ValueError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    if not models or not inventory:
        console.print(
            "[red]error:[/red] nothing to plan: give models (--file, or registry versions "
            "with metadata gpu_memory_gb) and GPUs (--gpus or the file's gpus)"
        )
        raise typer.Exit(2)
    result = plan(models, inventory, rules)
    if as_json:
        print(
            json.dumps(
                {
                    "gpus_used": result.used,
                    "lower_bound": result.lower_bound,
                    "gpus": [
                        {"gpu": name, "used_gb": used, "memory_gb": size, "replicas": replicas}
                        for name, used, size, replicas in rows(result)
                    ],
                    "unplaced": [f"{r.model}[{r.index}]" for r in result.unplaced],
                },
                indent=2,
            )
        )
    else:
        table = Table("GPU", "used GB", "of GB", "replicas")
        for name, used, size, replicas in rows(result):
            table.add_row(name, f"{used:g}", f"{size:g}", ", ".join(replicas))
        console.print(table)
        console.print(
            f"{result.used} GPU(s) used; lower bound {result.lower_bound}; "
            f"{sum(m.replicas for m in models)} replicas of {len(models)} models"
        )
        if result.unplaced:
            unplaced = ", ".join(f"{r.model}[{r.index}]" for r in result.unplaced)
            console.print(f"[red]not placed (the inventory is too small):[/red] {unplaced}")
    if result.unplaced:
        raise typer.Exit(1)


def _from_registry(config: Path | None, data_dir: Path | None) -> list[Any]:
    """Deployed (or serving) versions that declare ``gpu_memory_gb`` in their metadata."""
    from inferd.control.gpu_plan import ModelNeed

    needs = []
    with _registry(config, data_dir) as registry:
        deployments = {(d.model_name, d.version): d for d in registry.deployments.list_all()}
        for model in registry.list_models():
            if not model.loaded or not model.versions:
                continue
            running = [v for v in model.versions if (model.name, v.version) in deployments]
            for version in running or [model.versions[-1]]:
                memory = version.metadata.get("gpu_memory_gb")
                if not isinstance(memory, int | float):
                    continue
                row = deployments.get((model.name, version.version))
                replicas = (row.replicas if row else None) or int(
                    (version.batching or {}).get("replicas") or 1
                )
                latency = str(version.metadata.get("latency_class", "standard"))
                needs.append(
                    ModelNeed(f"{model.name}:{version.version}", float(memory), replicas, latency)
                )
    return needs
