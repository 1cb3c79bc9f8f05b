"""Alembic environment. target_metadata is ``gateway.db.models.Base.metadata``: importing
``gateway.db.models`` registers every table of tiergate, nothing else is needed.

The URL comes from ``config.attributes["url"]`` (set by gateway.db.migrate) or, when run
through plain ``alembic`` with alembic.ini, from config.yaml via load_settings().
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from gateway.db.models import Base
from gateway.db.session import database_url, make_engine

config = context.config
if config.config_file_name is not None:  # plain `alembic` with alembic.ini: use its logging setup
    fileConfig(config.config_file_name, disable_existing_loggers=False)
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("url")
    if url:
        return str(url)
    from gateway.settings import load_settings

    return database_url(load_settings()).render_as_string(hide_password=False)


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, target_metadata=target_metadata,
                              render_as_batch=connection.dialect.name == "sqlite", compare_type=True)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
