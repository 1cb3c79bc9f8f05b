"""The one declarative ``Base`` of tiergate and the column types its tables share.

Every table is declared on this ``Base`` inside ``gateway.db.models``; importing
``gateway.db.models`` registers all of them, so ``Base.metadata`` is complete for Alembic's
drift check and ``create_all``. Imports only SQLAlchemy.
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase

MONEY = sa.Numeric(18, 9)  # USD with nine decimals: integer nano-USD, exactly
ID = sa.String(64)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    """The one declarative base of tiergate; import it from ``gateway.db.models``, never define another."""

    metadata = sa.MetaData(naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    })
