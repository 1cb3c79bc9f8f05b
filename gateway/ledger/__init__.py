"""The spend ledger: one row per upstream call, recorded losslessly off the response path.

Public API: ``Ledger`` (start/stop, record, record_durable, record_request, wait_durable(level),
flush, health), ``Durability`` / ``DURABILITY_LEVELS`` (process | fsync | none),
``LedgerEntry``, ``RequestRecord`` (money in integer nano-USD), ``new_entry_id``, ``cost_nanos_for``,
``preload_prices``, ``LedgerError``,
``LedgerHealth``. Must not import web frameworks, the pipeline, routes or the app.
"""

from gateway.ledger.entries import IN_PROGRESS, LedgerEntry, RequestRecord, new_entry_id
from gateway.ledger.pricing import cost_nanos_for, preload_prices, price_for
from gateway.ledger.service import DURABILITY_LEVELS, Durability, Ledger, LedgerError, LedgerHealth

__all__ = ["DURABILITY_LEVELS", "IN_PROGRESS", "Durability", "Ledger", "LedgerEntry", "LedgerError", "LedgerHealth", "RequestRecord",
           "cost_nanos_for", "new_entry_id", "preload_prices", "price_for"]
