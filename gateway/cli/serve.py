"""`tiergate serve`: run the gateway with uvicorn."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Attach the `serve` command to the root app."""
