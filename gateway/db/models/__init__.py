"""Every ORM table of tiergate, on one declarative ``Base``.

Importing this package registers all tables, so ``Base.metadata`` is complete (Alembic's
``env.py`` and ``create_all`` need nothing else): ``core`` (tenants, API keys, requests, the
per-call ledger and its indexes, daily spend and its rollups, feedback), ``budgets`` (policies, persisted
holds, alerts), ``jobs`` (files, batches, batch lines), ``routing`` (the classifier's logged
decisions and the outcomes it learns from), ``audit`` (the admin audit log). No other package declares a table or
adds to this metadata. Imports only SQLAlchemy; the bottom of the gateway's layers.
"""

from gateway.db.models.audit import AdminAuditRow
from gateway.db.models.base import ID, MONEY, Base, utcnow
from gateway.db.models.budgets import BudgetAlertRow, BudgetPolicyRow, BudgetReservationRow
from gateway.db.models.core import (
           ApiKey,
           DailySpend,
           DailyTierSpend,
           Feedback,
           LedgerEntryRow,
           LedgerIntentRow,
           Request,
           Tenant,
           TenantSpendSpan,
)
from gateway.db.models.jobs import Batch, BatchLine, FileObject
from gateway.db.models.routing import RoutingDecision, RoutingOutcome

__all__ = ["ID", "MONEY", "AdminAuditRow", "ApiKey", "Base", "Batch", "BatchLine", "BudgetAlertRow",
           "BudgetPolicyRow", "BudgetReservationRow", "DailySpend", "DailyTierSpend", "Feedback", "FileObject",
           "LedgerEntryRow", "LedgerIntentRow", "Request", "RoutingDecision", "RoutingOutcome", "Tenant",
           "TenantSpendSpan", "utcnow"]
