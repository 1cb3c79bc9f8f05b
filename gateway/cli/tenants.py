"""`tiergate tenants` and `tiergate keys`: tenant and API-key administration.

A new key is printed exactly once, on stdout; only its SHA-256 hash and a short visible
prefix are stored, and it is never logged."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

tenants_app = typer.Typer(help="Tenants.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys (a new key is printed once).", no_args_is_help=True)

ConfigOption = typer.Option(None, "--config", "-c", envvar="TIERGATE_CONFIG", help="Path to config.yaml.")
JsonOption = typer.Option(False, "--json", help="Print JSON instead of a table.")


@contextmanager
def _session(config: Path | None) -> Iterator[Any]:
    """A session in one transaction on the configured database; friendly errors."""
    import sqlalchemy.exc

    from gateway.db.queries import RecordNotFound
    from gateway.db.session import engine_from_settings, make_session_factory
    from gateway.settings import ConfigError, load_settings

    try:
        settings = load_settings(config)
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
    engine = engine_from_settings(settings)
    try:
        with make_session_factory(engine)() as session, session.begin():
            yield session
    except RecordNotFound as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    except sqlalchemy.exc.IntegrityError:
        typer.echo("error: that conflicts with an existing record (duplicate name?)", err=True)
        raise typer.Exit(1) from None
    except sqlalchemy.exc.OperationalError as err:
        typer.echo(f"error: database not ready ({err.orig}); run `tiergate db upgrade` first", err=True)
        raise typer.Exit(1) from None
    finally:
        engine.dispose()


def _table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = {c: max([len(c)] + [len(str(r[c])) for r in rows]) for c in columns}
    typer.echo("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        typer.echo("  ".join(str(r[c]).ljust(widths[c]) for c in columns))


def _print(rows: list[dict[str, Any]], columns: list[str], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(rows, default=str, indent=2))
    else:
        _table(rows, columns)


@tenants_app.command("create")
def tenants_create(name: str, allow_prompt_storage: bool = typer.Option(
                       False, help="Allow storing prompt text for classifier feedback."),
                   config: Path | None = ConfigOption) -> None:
    """Create a tenant."""
    from gateway.db.queries import create_tenant

    with _session(config) as s:
        tenant = create_tenant(s, name, allow_prompt_storage=allow_prompt_storage)
        typer.echo(f"created tenant {tenant.name} ({tenant.id})")


@tenants_app.command("set")
def tenants_set(tenant: str = typer.Argument(..., help="Tenant id or name."),
                exploration: float | None = typer.Option(
                    None, min=0.0, max=1.0, help="Share of this tenant's auto requests routed to a random tier "
                    "to learn from (default: routing.exploration)."),
                default_exploration: bool = typer.Option(False, "--default-exploration",
                                                         help="Use routing.exploration again."),
                target_quality: float | None = typer.Option(
                    None, min=0.0, max=1.0, help="Keep at least this share of the all-strong quality (thresholds "
                    "from the router's quality curve measured on outcomes)."),
                target_cost: float | None = typer.Option(
                    None, min=0.0, max=1.0, help="Spend at most this share of the all-strong cost."),
                default_target: bool = typer.Option(False, "--default-target", help="Use the configured target again."),
                allow_prompt_storage: bool | None = typer.Option(None, "--allow-prompt-storage/--no-prompt-storage"),
                config: Path | None = ConfigOption) -> None:
    """Change a tenant's settings (takes effect within server.key_cache_ttl_s)."""
    from gateway.db.queries import find_tenant

    with _session(config) as s:
        t = find_tenant(s, tenant)
        if exploration is not None or default_exploration:
            t.routing_exploration = None if default_exploration else exploration
        if target_quality is not None and target_cost is not None:
            typer.echo("error: give --target-quality or --target-cost, not both", err=True)
            raise typer.Exit(2)
        if target_quality is not None or target_cost is not None or default_target:
            t.routing_target_quality, t.routing_target_cost = target_quality, target_cost
        if allow_prompt_storage is not None:
            t.allow_prompt_storage = allow_prompt_storage
        typer.echo(f"tenant {t.name} ({t.id}): exploration "
                   f"{'default' if t.routing_exploration is None else t.routing_exploration}, "
                   f"target {_target(t)}, prompt storage {'allowed' if t.allow_prompt_storage else 'off'}")


def _target(t: Any) -> str:
    if t.routing_target_quality is not None:
        return f"quality >= {t.routing_target_quality}"
    return "default" if t.routing_target_cost is None else f"cost <= {t.routing_target_cost}"


@tenants_app.command("list")
def tenants_list(config: Path | None = ConfigOption, as_json: bool = JsonOption) -> None:
    """List tenants."""
    from gateway.db.queries import list_tenants

    with _session(config) as s:
        rows = [{"id": t.id, "name": t.name, "allow_prompt_storage": t.allow_prompt_storage,
                 "exploration": "default" if t.routing_exploration is None else t.routing_exploration,
                 "target": _target(t), "created_at": t.created_at.isoformat()} for t in list_tenants(s)]
    _print(rows, ["id", "name", "allow_prompt_storage", "exploration", "target", "created_at"], as_json)


@keys_app.command("create")
def keys_create(tenant: str = typer.Option(..., "--tenant", "-t", help="Tenant id or name."),
                name: str = typer.Option("", "--name", "-n", help="A label for the key."),
                config: Path | None = ConfigOption) -> None:
    """Create an API key for TENANT. The key is printed once; store it now."""
    from gateway.auth import generate_key, hash_key
    from gateway.db.queries import add_api_key, find_tenant

    raw = generate_key()
    with _session(config) as s:
        t = find_tenant(s, tenant)
        key = add_api_key(s, t.id, raw, hash_key(raw), name)
        key_id, prefix, tenant_name = key.id, key.prefix, t.name
    typer.echo(f"created key {key_id} (prefix {prefix}) for tenant {tenant_name}", err=True)
    typer.echo("this is the only time the key is shown:", err=True)
    typer.echo(raw)


@keys_app.command("list")
def keys_list(tenant: str | None = typer.Option(None, "--tenant", "-t", help="Tenant id or name."),
              config: Path | None = ConfigOption, as_json: bool = JsonOption) -> None:
    """List API keys (prefix only; keys are stored hashed) with their tenant's name and their spend
    this month (UTC) and in all."""
    from gateway.budgets import window_for
    from gateway.budgets.periods import utc_now
    from gateway.budgets.spend import spent_nanos
    from gateway.db.models import Tenant
    from gateway.db.queries import find_tenant, list_api_keys
    from gateway.money import usd_number

    month, total = window_for("month", utc_now()), window_for("total", utc_now())
    with _session(config) as s:
        tenant_id = find_tenant(s, tenant).id if tenant else None
        names = {t.id: t.name for t in s.query(Tenant)}
        rows = [{"id": k.id, "tenant": names.get(k.tenant_id, k.tenant_id), "tenant_id": k.tenant_id,
                 "name": k.name, "prefix": k.prefix,
                 "spent_month_usd": usd_number(spent_nanos(s, "key", k.id, month)),
                 "spent_total_usd": usd_number(spent_nanos(s, "key", k.id, total)),
                 "created_at": k.created_at.isoformat(),
                 "revoked_at": k.revoked_at.isoformat() if k.revoked_at else ""}
                for k in list_api_keys(s, tenant_id)]
    _print(rows, ["id", "tenant", "name", "prefix", "spent_month_usd", "spent_total_usd", "created_at", "revoked_at"],
           as_json)


@keys_app.command("revoke")
def keys_revoke(key: str = typer.Argument(..., help="Key id (or its visible prefix)."),
                config: Path | None = ConfigOption) -> None:
    """Revoke an API key. Every running gateway refuses it within server.key_cache_ttl_s (1 s)."""
    from gateway.db.queries import revoke_api_key

    with _session(config) as s:
        k = revoke_api_key(s, key)
        key_id, revoked = k.id, k.revoked_at
    typer.echo(f"revoked key {key_id} at {revoked.isoformat() if revoked else '?'}")
