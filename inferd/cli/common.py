"""What every ``inferd`` command shares: the Typer apps, the console, common options, and
reading settings and the registry."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from inferd.config import Settings, load_settings
from inferd.errors import InferdError
from inferd.jobs import cli as jobs_cli

if TYPE_CHECKING:
    pass


app = typer.Typer(
    help="inferd: serve any model fast, versioned and observable.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(
    help="The model registry: push, list, show, load, unload.", no_args_is_help=True
)
app.add_typer(models_app, name="models")
keys_app = typer.Typer(help="API keys: create, list, revoke.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(jobs_cli.app, name="jobs")
console = Console(stderr=True)

UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar="INFERD_URL",
        help="A running server to talk to (default: $INFERD_URL; none: this machine's "
        "registry files). An https:// server's certificate is checked against the CAs in "
        "$SSL_CERT_FILE, else the system's.",
    ),
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option("--api-key", envvar="INFERD_API_KEY", help="API key (default: $INFERD_API_KEY)."),
]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="YAML settings file.")]
DataDirOpt = Annotated[
    Path | None, typer.Option("--data-dir", help="Data folder (INFERD_DATA_DIR).")
]


def _settings(config: Path | None, **overrides: Any) -> Settings:
    try:
        return load_settings(config, **overrides)
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _registry(config: Path | None, data_dir: Path | None) -> Any:
    from inferd.registry import Registry

    return Registry.from_settings(_settings(config, data_dir=data_dir))


@contextmanager
def _errors() -> Any:
    try:
        yield
    except InferdError as exc:
        console.print(f"[red]error ({exc.status_code} {exc.code}):[/red] {escape(exc.message)}")
        raise typer.Exit(1) from None


_ACTOR = "cli"
"""Who the registry records as making a change from the command line."""
_PICKED_UP = "a running server acts on it at its next reconcile"
