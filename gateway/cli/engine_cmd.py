"""`tiergate engine`: the local MoE engine."""

from __future__ import annotations

import typer

app = typer.Typer(help="The local MoE engine.", no_args_is_help=True)
