"""Database layer: ``models`` (every ORM table of tiergate on one declarative ``Base``), ``session``
(engines, session factories), ``queries`` (named tenant/key/ledger queries), ``migrate``
(Alembic, configured programmatically). The bottom of the gateway's layers: imports only
settings and errors from the rest of the gateway."""
