"""The spend ledger: one row per upstream call, recorded losslessly off the response path.

Public API: ``Ledger`` (start/stop, begin (a call's intent, before the call), record,
record_durable, record_request, wait_durable(level), flush, wait_settled, health),
``Durability`` / ``DURABILITY_LEVELS`` (process | fsync | none), ``LedgerEntry``,
``RequestRecord``, ``CallIntent`` (money in integer nano-USD), ``new_entry_id``, ``cost_nanos_for``,
``preload_prices``, ``LedgerError``,
``LedgerHealth``. Must not import web frameworks, the pipeline, routes or the app.
"""

from gateway.ledger.entries import (
           IN_PROGRESS,
           INTERRUPTED,
           CallIntent,
           LedgerEntry,
           RequestRecord,
           new_entry_id,
)
from gateway.ledger.pricing import cost_nanos_for, preload_prices, price_for
from gateway.ledger.service import DURABILITY_LEVELS, Durability, Ledger, LedgerError, LedgerHealth

__all__ = ["DURABILITY_LEVELS", "INTERRUPTED", "IN_PROGRESS", "CallIntent", "Durability", "Ledger", "LedgerEntry", "LedgerError", "LedgerHealth", "RequestRecord",
           "cost_nanos_for", "new_entry_id", "preload_prices", "price_for"]
