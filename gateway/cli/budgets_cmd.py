"""`tiergate budgets set|show`: budgets and rate limits per tenant and per API key.

Writes the same ``budgets`` rows as the admin API, held to the same bounds
(gateway.budgets.bounds: a bad value exits 2 naming it); running gateways pick changes up within
their policy cache TTL (a few seconds). ``show`` prints each policy with the spend the
database has settled in its current UTC period (live holds of running gateways are not
included; the admin API shows those).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(help="Budgets and rate limits per tenant and API key.", no_args_is_help=True)
ConfigOption = typer.Option(None, "--config", "-c", envvar="TIERGATE_CONFIG", help="Path to config.yaml.")


def _resolve_tenant(session: Any, tenant: str) -> str:
    from sqlalchemy import select

    from gateway.db.models import Tenant

    row = session.get(Tenant, tenant) or session.scalars(select(Tenant).where(Tenant.name == tenant)).first()
    if row is None:
        typer.echo(f"error: no tenant with id or name {tenant!r}", err=True)
        raise typer.Exit(1)
    return str(row.id)


def _check_key(session: Any, tenant_id: str, key_id: str) -> None:
    from gateway.db.models import ApiKey

    key = session.get(ApiKey, key_id)
    if key is None or key.tenant_id != tenant_id:
        typer.echo(f"error: tenant has no API key with id {key_id!r}", err=True)
        raise typer.Exit(1)


@app.command("set")
def set_budget(
    tenant: str = typer.Option(..., "--tenant", "-t", help="Tenant id or name."),
    key: str | None = typer.Option(None, "--key", "-k", help="API key id: set the key's budget instead."),
    period: str | None = typer.Option(None, help="day | week | month | total (UTC)."),
    limit_usd: str | None = typer.Option(None, "--limit-usd", help="Hard limit in USD (whole nano-dollars, "
                                         "at most 100000000): 429 budget_exceeded beyond."),
    soft_limit_usd: str | None = typer.Option(None, "--soft-limit-usd",
                                              help="Soft limit: alert + effort cap (default: a fraction of the hard limit)."),
    alerts: str | None = typer.Option(None, help="Alert thresholds as fractions, e.g. 0.5,0.8,1.0."),
    rpm: int | None = typer.Option(None, "--rpm", help="Requests per minute."),
    tpm: int | None = typer.Option(None, "--tpm", help="Tokens per minute."),
    clear: list[str] = typer.Option([], help="Remove a setting: limit_usd, soft_limit_usd, alert_thresholds, "
                                         "requests_per_min, tokens_per_min (repeatable)."),
    config: Path | None = ConfigOption,
) -> None:
    """Create or update a budget / rate-limit policy."""
    from gateway.budgets import put_policy
    from gateway.cli.tenants import _session

    try:
        thresholds = [float(x) for x in alerts.split(",")] if alerts else None
    except ValueError:
        typer.echo("error: alert_thresholds must be comma-separated fractions, e.g. 0.5,0.8,1.0", err=True)
        raise typer.Exit(2) from None
    with _session(config) as session:
        tenant_id = _resolve_tenant(session, tenant)
        if key:
            _check_key(session, tenant_id, key)
        try:
            row = put_policy(session, scope="key" if key else "tenant", tenant_id=tenant_id, key_id=key,
                             period=period, limit_usd=limit_usd, soft_limit_usd=soft_limit_usd,  # type: ignore[arg-type]
                             alert_thresholds=thresholds, requests_per_min=rpm, tokens_per_min=tpm, clear=clear)
        except ValueError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"budget {row.id}: period={row.period} limit_usd={row.limit_usd} "
                   f"soft_limit_usd={row.soft_limit_usd} alerts={row.alert_thresholds} "
                   f"rpm={row.requests_per_min} tpm={row.tokens_per_min}")


def _held_nanos(session: Any, tenant_id: str, counter_key: str) -> int:
    """Open holds (embedded mode's ``budget_reservations``, still leased) on one counter."""
    from sqlalchemy import select

    from gateway.budgets.periods import utc_now
    from gateway.db.models import BudgetReservationRow

    rows = session.scalars(select(BudgetReservationRow).where(
        BudgetReservationRow.tenant_id == tenant_id, BudgetReservationRow.status == "held")).all()
    now = utc_now()
    return sum(r.amount_nanos for r in rows if counter_key in (r.counters or [])
               and (r.expires_at if r.expires_at.tzinfo else r.expires_at.replace(tzinfo=now.tzinfo)) > now)


@app.command("show")
def show_budgets(
    tenant: str = typer.Option(..., "--tenant", "-t", help="Tenant id or name."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    config: Path | None = ConfigOption,
) -> None:
    """Show a tenant's policies (tenant and keys) as the gateway enforces them: hard limit, effective
    soft limit, settled spend in the current period, held, remaining and % used."""
    from gateway.budgets import get_policy_rows, window_for
    from gateway.budgets.periods import utc_now
    from gateway.budgets.policies import effective_policy
    from gateway.budgets.spend import spent_nanos
    from gateway.cli.tenants import _session
    from gateway.money import usd_number
    from gateway.settings import load_settings

    with _session(config) as session:  # (exits 2 on a bad config before the settings are read again)
        settings = load_settings(config)
        shared = settings.redis.resolved_url() is not None  # holds then live in Redis, not the database
        tenant_id = _resolve_tenant(session, tenant)
        out: list[dict[str, Any]] = []
        for row in get_policy_rows(session, tenant_id):
            policy = effective_policy(row, settings.budgets)
            window = window_for(policy.period, utc_now())
            subject_id = row.key_id if row.scope == "key" else row.tenant_id
            spent = spent_nanos(session, row.scope, subject_id or "", window)
            held = None if shared else _held_nanos(session, tenant_id, f"{row.id}|{window.key}")
            limit = policy.limit_nanos
            out.append({
                "subject": row.id, "period": window.key,
                "limit_usd": None if limit is None else usd_number(limit),
                "soft_limit_usd": None if policy.soft_limit_nanos is None else usd_number(policy.soft_limit_nanos),
                "soft_limit_source": "set" if row.soft_limit_usd is not None else
                                     (f"{settings.budgets.soft_limit_fraction:.0%} of the hard limit"
                                      if policy.soft_limit_nanos is not None else None),
                "spent_usd": usd_number(spent), "held_usd": None if held is None else usd_number(held),
                "remaining_usd": None if limit is None else usd_number(max(0, limit - spent - (held or 0))),
                "used_pct": None if not limit else round(100 * spent / limit, 1),
                "alert_thresholds": list(policy.alert_thresholds),
                "rpm": row.requests_per_min, "tpm": row.tokens_per_min})
    if as_json:
        typer.echo(json.dumps(out, indent=2))
        return
    if not out:
        typer.echo("no budgets set for this tenant (config defaults apply)")
        return
    from gateway.cli.tenants import _table

    def usd(v: float | None) -> str:
        return "-" if v is None else f"${v:,.6f}".rstrip("0").rstrip(".")

    _table([{"subject": r["subject"], "period": r["period"], "limit": usd(r["limit_usd"]),
             "soft limit": usd(r["soft_limit_usd"]) + (" (default)" if r["soft_limit_source"] not in (None, "set") else ""),
             "spent": usd(r["spent_usd"]), "held": "see admin API" if r["held_usd"] is None else usd(r["held_usd"]),
             "remaining": usd(r["remaining_usd"]), "used": "-" if r["used_pct"] is None else f"{r['used_pct']}%",
             "rpm": r["rpm"] or "-", "tpm": r["tpm"] or "-"} for r in out],
           ["subject", "period", "limit", "soft limit", "spent", "held", "remaining", "used", "rpm", "tpm"])
    if any(r["soft_limit_source"] not in (None, "set") for r in out):
        typer.echo(f"(default) soft limit: {settings.budgets.soft_limit_fraction:.0%} of the hard limit "
                   "(budgets.soft_limit_fraction), as the gateway enforces it")
    if shared:
        typer.echo("held: with Redis, live holds are in Redis; GET /admin/budgets/tenants/{id} shows them")
