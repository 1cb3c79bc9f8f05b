"""Database layer: ``models`` (the shared declarative ``Base`` and core tables), ``session``
(engines, session factories), ``queries`` (named tenant/key/ledger queries), ``migrate``
(Alembic, configured programmatically). The bottom of the gateway's layers: imports only
settings and errors from the rest of the gateway."""
