"""`tiergate db`: database migrations (Alembic, configured from config.yaml; works from a
fresh checkout and creates the SQLite file under var/ by default)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Database migrations.", no_args_is_help=True)

ConfigOption = typer.Option(None, "--config", "-c", envvar="TIERGATE_CONFIG", help="Path to config.yaml.")


def _url(config: Path | None) -> str:
    from gateway.db.session import database_url
    from gateway.settings import ConfigError, load_settings

    try:
        settings = load_settings(config)
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
    return database_url(settings).render_as_string(hide_password=False)


def _shown(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


@app.command()
def upgrade(revision: str = typer.Argument("heads", help="Target revision (default: latest)."),
            config: Path | None = ConfigOption) -> None:
    """Migrate the database up to REVISION."""
    from gateway.db import migrate

    url = _url(config)
    migrate.upgrade(url, revision)
    typer.echo(f"database {_shown(url)} at {', '.join(migrate.current_revisions(url)) or 'base'}")


@app.command()
def downgrade(revision: str = typer.Argument("-1", help="Target revision ('base' drops everything)."),
              config: Path | None = ConfigOption) -> None:
    """Migrate the database down to REVISION."""
    from gateway.db import migrate

    url = _url(config)
    migrate.downgrade(url, revision)
    typer.echo(f"database {_shown(url)} at {', '.join(migrate.current_revisions(url)) or 'base'}")


@app.command()
def current(config: Path | None = ConfigOption) -> None:
    """Print the revision the database is at."""
    from gateway.db import migrate

    url = _url(config)
    typer.echo(", ".join(migrate.current_revisions(url)) or "base (not migrated)")
