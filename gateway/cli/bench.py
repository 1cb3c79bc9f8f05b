"""`tiergate bench`: benchmarks that print ratios against a baseline run in the same process."""

from __future__ import annotations

import typer

app = typer.Typer(help="Benchmarks that print ratios against a baseline run in the same process.", no_args_is_help=True)
