"""`tiergate batches list|show|cancel`: the operator's view of batch jobs, read from the database
(every tenant's; the gateway and its workers need not be reachable). ``show`` draws a progress bar
(rich) with the lines done, ok, failed, cancelled and running, and an ETA at the rate lines have
settled so far; ``--watch`` redraws it until the batch is final. ``cancel`` does what
``POST /v1/batches/{id}/cancel`` does: pending lines are cancelled at once, running ones finish.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(help="Batch jobs: list, progress, cancel.", no_args_is_help=True)
ConfigOption = typer.Option(None, "--config", "-c", envvar="TIERGATE_CONFIG", help="Path to config.yaml.")
JsonOption = typer.Option(False, "--json", help="Print JSON instead of a table.")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _view(session: Any, batch: Any) -> dict[str, Any]:
    """A batch as the CLI shows it: its OpenAI object's main fields, the tenant's name, line
    states and the ETA."""
    from gateway.db.models import Tenant
    from gateway.jobs import progress as views
    from gateway.jobs import store

    p = views.progress(session, batch.id, store.utc_now())
    counts = store.line_counts(session, [batch.id]).get(batch.id, {"completed": 0, "failed": 0})
    tenant = session.get(Tenant, batch.tenant_id)
    body = store.batch_json(batch, counts)
    eta = views.eta_seconds(p, batch.in_progress_at, store.utc_now()) if batch.status in store.OPEN else None
    notes = [e["message"] for e in (batch.errors or [])]
    if p["stalled"]:
        notes.append(f"{p['stalled']} running line(s) lost their worker (lease ran out with no heartbeat): "
                     "they run again when a worker claims them")
    return {"id": batch.id, "tenant": tenant.name if tenant else batch.tenant_id, "status": batch.status,
            "total": batch.total, "completed": counts["completed"], "failed": counts["failed"],
            "cancelled": p["cancelled"], "expired": p["expired"], "running": p["running"],
            "pending": p["pending"], "settled": p["done"] + p["cancelled"] + p["expired"],
            "eta_s": None if eta is None else round(eta, 1), "created_at": batch.created_at.isoformat(),
            "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id, "notes": notes,
            "request_counts": body["request_counts"]}


def _load(config: Path | None, batch_id: str) -> dict[str, Any]:
    from gateway.cli.tenants import _session
    from gateway.jobs import store

    with _session(config) as s:
        batch = s.get(store.Batch, batch_id)
        if batch is None:
            typer.echo(f"error: no batch {batch_id!r}", err=True)
            raise typer.Exit(1)
        return _view(s, batch)


def _render(v: dict[str, Any]) -> Any:
    """The progress display of one batch (a rich renderable)."""
    from rich.console import Group
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn
    from rich.text import Text

    bar = Progress(TextColumn("{task.description}"), BarColumn(bar_width=40), MofNCompleteColumn(),
                   TaskProgressColumn(), TextColumn("ETA {task.fields[eta]}"), auto_refresh=False)
    bar.add_task(escape(f"{v['id']} [{v['status']}]"), total=v["total"], completed=v["settled"], eta=_duration(v["eta_s"]))
    lines = [Text(f"tenant {v['tenant']}: {v['completed']} ok, {v['failed']} failed, {v['cancelled']} cancelled, "
                  f"{v['expired']} expired, {v['running']} running, {v['pending']} pending")]
    lines += [Text(f"note: {n}", style="yellow") for n in v["notes"]]
    if v["output_file_id"] or v["error_file_id"]:
        lines.append(Text(f"output file {v['output_file_id'] or '-'}, error file {v['error_file_id'] or '-'}"))
    return Group(bar, *lines)


@app.command("list")
def batches_list(tenant: str | None = typer.Option(None, "--tenant", "-t", help="Tenant id or name."),
                 status: str | None = typer.Option(None, help="Only batches with this status."),
                 limit: int = typer.Option(50, min=1, max=10_000, help="At most this many, newest first."),
                 config: Path | None = ConfigOption, as_json: bool = JsonOption) -> None:
    """List batches of every tenant (or one) with their progress."""
    from gateway.cli.tenants import _print, _session
    from gateway.db.queries import find_tenant
    from gateway.jobs import progress as views

    with _session(config) as s:
        tenant_id = find_tenant(s, tenant).id if tenant else None
        rows = [_view(s, b) for b in views.all_batches(s, tenant_id=tenant_id, status=status, limit=limit)]
    if as_json:
        typer.echo(json.dumps(rows, default=str, indent=2))
        return
    for r in rows:
        r["progress"] = f"{r['settled']}/{r['total']}"
        r["eta"] = _duration(r["eta_s"])
        r["note"] = "; ".join(r["notes"])[:60]
    _print(rows, ["id", "tenant", "status", "progress", "completed", "failed", "cancelled", "running", "eta",
                  "created_at", "note"], False)


def _worker_note(config: Path | None) -> str | None:
    """With ``jobs.backend: celery``: a note when no worker consumes the batch queue right now
    (or the broker cannot be asked); None otherwise."""
    from gateway.settings import load_settings

    settings = load_settings(config)
    if settings.jobs.backend != "celery":
        return None  # embedded: every gateway process runs batches
    from gateway.jobs.celery_app import consumers, make_celery

    celery = make_celery(settings)
    try:
        n = consumers(celery, settings.jobs.queue)
    except Exception as err:  # only a note: the view itself came from the database
        return f"the broker could not be asked for workers ({type(err).__name__})"
    finally:
        celery.close()
    return None if n else (f"No tiergate worker is consuming the batch queue '{settings.jobs.queue}' now: "
                           "lines wait until one starts (`tiergate worker --config config.yaml`)")


@app.command("show")
def batches_show(batch_id: str = typer.Argument(..., help="Batch id."),
                 watch: bool = typer.Option(False, "--watch", "-w", help="Redraw until the batch is final."),
                 interval: float = typer.Option(1.0, min=0.1, help="Seconds between redraws with --watch."),
                 config: Path | None = ConfigOption, as_json: bool = JsonOption) -> None:
    """A batch's progress: a bar, counts, ETA (and the output / error file ids once final)."""
    from rich.console import Console
    from rich.live import Live

    from gateway.jobs import store

    v = _load(config, batch_id)
    if v["status"] in store.OPEN:
        note = _worker_note(config)
        if note and not any("No tiergate worker" in n for n in v["notes"]):
            v["notes"].append(note)
    if as_json:
        typer.echo(json.dumps(v, default=str, indent=2))
        return
    console = Console()
    if not watch or v["status"] in store.FINAL:
        console.print(_render(v))
        return
    with Live(_render(v), console=console, auto_refresh=False) as live:
        while v["status"] not in store.FINAL:
            time.sleep(interval)
            v = _load(config, batch_id)
            live.update(_render(v), refresh=True)


@app.command("cancel")
def batches_cancel(batch_id: str = typer.Argument(..., help="Batch id."), config: Path | None = ConfigOption) -> None:
    """Cancel a batch: pending lines are cancelled at once, running ones finish (the code path of
    ``POST /v1/batches/{id}/cancel``)."""
    from gateway.db.session import engine_from_settings, make_session_factory
    from gateway.errors import GatewayError, NotFound
    from gateway.jobs import store
    from gateway.settings import load_settings

    engine = engine_from_settings(load_settings(config))
    try:
        with make_session_factory(engine)() as s:
            store.request_cancel(s, None, batch_id, store.utc_now())
    except NotFound:
        typer.echo(f"error: no batch {batch_id!r}", err=True)
        raise typer.Exit(1) from None
    except GatewayError as err:
        typer.echo(f"error: {err.message}", err=True)
        raise typer.Exit(1) from None
    finally:
        engine.dispose()
    v = _load(config, batch_id)
    typer.echo(f"batch {batch_id}: {v['status']} ({v['completed']} ok, {v['failed']} failed, "
               f"{v['cancelled']} cancelled, {v['running']} still running)")
