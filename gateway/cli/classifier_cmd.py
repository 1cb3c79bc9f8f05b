"""`tiergate classifier`: the effort classifier."""

from __future__ import annotations

import typer

app = typer.Typer(help="The effort classifier.", no_args_is_help=True)
