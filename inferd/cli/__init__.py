"""The ``inferd`` command line. The only place that configures logging for the server.

Each command group is a module of this package; importing it registers its commands on
:data:`inferd.cli.common.app`.
"""

from __future__ import annotations

from typing import Annotated

import typer

import inferd
from inferd.cli.common import app

# isort: off
# The order commands register in is the order ``inferd --help`` lists them.
from inferd.cli import serve, models, keys, deployments, client, plan
# isort: on

__all__ = ["app", "client", "deployments", "keys", "main", "models", "plan", "serve"]


def _version_callback(value: bool) -> None:
    if value:
        print(f"inferd {inferd.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version_callback, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    pass


def main() -> None:
    app()
