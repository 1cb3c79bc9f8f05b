"""`tiergate tenants` and `tiergate keys`: tenant and API-key administration."""

from __future__ import annotations

import typer

tenants_app = typer.Typer(help="Tenants.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys (a new key is printed once).", no_args_is_help=True)
