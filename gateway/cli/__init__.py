"""The `tiergate` command line. Each command group lives in its own module."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import typer

# Plain (click-style) help: typer's rich panels print a value type after every flag ("--help <bool>",
# "--demo <bool>"), as if flags took a value; the plain layout shows "--flag / --no-flag" and no type.
# Sub-apps inherit the mode.
app = typer.Typer(help="tiergate: an OpenAI-compatible gateway that spends compute where it pays.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None)


def _register() -> None:
    # Imported lazily so that `tiergate --help` stays fast and nothing heavy loads at import.
    from gateway.cli import (
        batches_cmd,
        bench,
        budgets_cmd,
        classifier_cmd,
        db_cmd,
        engine_cmd,
        routing_cmd,
        serve,
        tenants,
    )

    app.add_typer(db_cmd.app, name="db")
    app.add_typer(tenants.tenants_app, name="tenants")
    app.add_typer(tenants.keys_app, name="keys")
    app.add_typer(engine_cmd.app, name="engine")
    app.add_typer(classifier_cmd.app, name="classifier")
    app.add_typer(routing_cmd.app, name="routing")
    app.add_typer(bench.app, name="bench")
    app.add_typer(budgets_cmd.app, name="budgets")
    app.add_typer(batches_cmd.app, name="batches")
    bench.app.command("routing")(classifier_cmd.bench_routing)
    serve.register(app)
    from gateway.cli import worker

    worker.register(app)


def main() -> None:
    _register()
    app()
