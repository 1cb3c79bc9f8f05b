"""`tiergate routing`: the router's learning loop on outcomes.

- ``import FILE``: an evaluation of your own (JSONL: ``prompt`` or ``messages``, and per-arm
  ``outcomes`` in [0, 1] — full or partial; ``bbh_direct_vs_cot.jsonl``'s columns are understood
  too) as outcome rows to learn from.
- ``learn``: one incremental off-policy update from the outcomes logged since the last one,
  published to every replica only if it does not score worse on held-back traffic; ``--watch``
  repeats it every ``--interval`` seconds (run one learner per deployment).
Imports the learning package lazily; prints what happened."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session, sessionmaker

    from gateway.settings import Settings

app = typer.Typer(help="Learn routing from outcomes (feedback, reviews, imported evaluations).",
                  no_args_is_help=True)
ConfigOption = typer.Option(None, "--config", "-c", envvar="TIERGATE_CONFIG", help="Path to config.yaml.")


def _open(config: Path | None) -> tuple[Settings, Engine, sessionmaker[Session]]:
    from gateway.db.session import engine_from_settings, make_session_factory
    from gateway.settings import ConfigError, load_settings

    try:
        settings = load_settings(config)
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
    engine = engine_from_settings(settings)
    return settings, engine, make_session_factory(engine)


@app.command("import")
def import_file(path: Path = typer.Argument(..., exists=True, dir_okay=False, help="Outcomes file."),
                tenant: str | None = typer.Option(None, help="Tenant the outcomes belong to (none: global)."),
                config: Path | None = ConfigOption) -> None:
    """Import an outcomes file as outcome rows."""
    from gateway.learning.outcomes import import_outcomes

    _, engine, sf = _open(config)
    try:
        n = import_outcomes(sf, path, tenant_id=tenant)
    finally:
        engine.dispose()
    typer.echo(f"imported {n} outcome(s) from {path}")


@app.command("learn")
def learn(watch: bool = typer.Option(False, "--watch", help="Keep learning every --interval seconds."),
          interval: float = typer.Option(60.0, min=1.0, help="Seconds between updates with --watch."),
          config: Path | None = ConfigOption) -> None:
    """One incremental update of the router from new outcomes (see the module docstring)."""
    from gateway.learning.learner import learn_once

    settings, engine, sf = _open(config)
    try:
        while True:
            report = learn_once(settings, sf)
            typer.echo(report.line())
            if not watch:
                raise typer.Exit(0 if report.status != "refused" else 3)
            time.sleep(interval)
    finally:
        engine.dispose()
