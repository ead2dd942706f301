"""``inferd keys``: create, list, revoke API keys."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    pass
from inferd.cli.common import _ACTOR, ConfigOpt, DataDirOpt, _errors, _registry, console, keys_app


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Argument(help="What the key is for, e.g. checkout-service.")],
    scope: Annotated[
        list[str] | None, typer.Option("--scope", help="infer (default) or admin; repeatable.")
    ] = None,
    model: Annotated[
        list[str] | None,
        typer.Option("--model", help="Only these models (repeatable; default: all)."),
    ] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Create an API key; the key is printed (on stdout) this once, only its hash is kept."""
    with _errors(), _registry(config, data_dir) as registry:
        record, key = registry.keys.create(name, scope or ["infer"], model or None, _ACTOR)
    console.print(
        f"created key [bold]{record.key_id}[/bold] ({name}) with scopes {', '.join(record.scopes)}"
        + (f", models {', '.join(record.models)}" if record.models else "")
        + "; store it now: it is not shown again"
    )
    print(key)


@keys_app.command("list")
def keys_list(config: ConfigOpt = None, data_dir: DataDirOpt = None) -> None:
    """Every API key (never the key itself), revoked ones too."""
    with _errors(), _registry(config, data_dir) as registry:
        records = registry.keys.list_all()
    table = Table("key id", "name", "scopes", "models", "created (UTC)", "by", "revoked")
    for r in records:
        table.add_row(
            r.key_id, r.name, ", ".join(r.scopes), ", ".join(r.models or ["all"]),
            r.created_at.strftime("%Y-%m-%d %H:%M"), r.created_by,
            r.revoked_at.strftime("%Y-%m-%d %H:%M") if r.revoked_at else "-",
        )  # fmt: skip
    Console().print(table)


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (the 12 hex digits after ik_).")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Revoke a key: servers refuse it within ``auth.cache_s`` seconds (5)."""
    with _errors(), _registry(config, data_dir) as registry:
        registry.keys.revoke(key_id)
    console.print(f"revoked key [bold]{key_id}[/bold]")
