"""Alembic, configured programmatically: ``tiergate db upgrade`` works from a fresh checkout
without relying on the current directory. The script location is the repository's
``migrations/`` folder; the URL comes from the settings (or is passed in).
Must not import gateway modules other than settings and gateway.db.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import URL

from gateway.db.session import make_engine

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
HEAD_REVISION = "heads"
def alembic_config(url: str | URL) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Passed as an attribute, not an ini option: ini values undergo %-interpolation.
    cfg.attributes["url"] = url if isinstance(url, str) else url.render_as_string(hide_password=False)
    return cfg


def upgrade(url: str | URL, revision: str = HEAD_REVISION) -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | URL, revision: str = "-1") -> None:
    command.downgrade(alembic_config(url), revision)


def current_revisions(url: str | URL) -> tuple[str, ...]:
    """Revision ids the database is at (empty tuple: never migrated)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return tuple(MigrationContext.configure(conn).get_current_heads())
    finally:
        engine.dispose()
