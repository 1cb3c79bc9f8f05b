"""`tiergate serve`: run the gateway with uvicorn (uvloop + httptools, one worker by default), with
the edge limits of ``server:`` (header/body/keep-alive timeouts, concurrency; gateway.web.serving).

``--demo`` first migrates the database, creates a ``demo`` tenant with one key if none exists
(printing the key once, never logging it) and prints a working curl and openai-SDK example.
The app is built by ``app_from_env`` (a uvicorn factory) so several workers can each build
their own; ``--workers N`` (N > 1) is refused without Redis (``unshared_counters_refusal``).
Nothing heavy is imported until the command runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from gateway.settings import Settings

DEMO_TENANT = "demo"
ConfigOption = typer.Option(None, "--config", "-c", envvar="TIERGATE_CONFIG", help="Path to config.yaml.")


def app_from_env():  # type: ignore[no-untyped-def]  # uvicorn factory: returns the FastAPI app
    from gateway.app import create_app
    from gateway.settings import load_settings

    # One app per process: after startup its heap is frozen out of full garbage collections,
    # which otherwise stop the loop (every in-flight request) ~100+ ms every few seconds, and the
    # GIL switch interval is 0.2 ms (gateway.app.SWITCH_INTERVAL_S).
    return create_app(load_settings(os.environ.get("TIERGATE_CONFIG")), freeze_heap=True)


def _demo_key(config: Path | None) -> str | None:
    """Migrate, then create the demo tenant and a key on first run. Returns the new raw key, or
    None if the demo tenant already existed (its key was printed when it was created)."""
    from gateway.auth import generate_key, hash_key
    from gateway.db import migrate
    from gateway.db.queries import RecordNotFound, add_api_key, create_tenant, find_tenant
    from gateway.db.session import database_url, make_engine, make_session_factory
    from gateway.settings import load_settings

    settings = load_settings(config)
    url = database_url(settings)
    migrate.upgrade(url.render_as_string(hide_password=False))
    engine = make_engine(url)
    try:
        with make_session_factory(engine)() as s, s.begin():
            try:
                find_tenant(s, DEMO_TENANT)
                return None
            except RecordNotFound:
                tenant = create_tenant(s, DEMO_TENANT)
            raw = generate_key()
            add_api_key(s, tenant.id, raw, hash_key(raw), name="demo")
            return raw
    finally:
        engine.dispose()


def _dashboard_note(host: str, port: int, admin_key_env: str) -> str:
    """Where the admin dashboard is and how to log in (or how to turn it on)."""
    if os.environ.get(admin_key_env):
        return f"Admin dashboard: http://{host}:{port}/admin (log in with the key in ${admin_key_env})."
    return (f"Admin dashboard: off. Start with an admin key to turn it on, e.g.\n"
            f"    export {admin_key_env}=\"$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')\"\n"
            f"then open http://{host}:{port}/admin and log in with it.")


def _print_demo(host: str, port: int, key: str | None, admin_key_env: str = "TIERGATE_ADMIN_KEY") -> None:
    shown = key or "<your tiergate key>"
    if key:
        typer.echo(f"Created tenant '{DEMO_TENANT}' with API key (shown once, store it now):\n\n    {key}\n")
    else:
        typer.echo(f"Tenant '{DEMO_TENANT}' exists; its key was printed when it was created "
                   f"(new one: tiergate keys create --tenant {DEMO_TENANT}).\n")
    base = f"http://{host}:{port}/v1"
    typer.echo(f"""Try it:

curl {base}/chat/completions \\
  -H "Authorization: Bearer {shown}" -H "Content-Type: application/json" \\
  -d '{{"model": "auto", "messages": [{{"role": "user", "content": "Say hello"}}]}}'

python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{base}", api_key="{shown}")
r = client.chat.completions.create(model="auto", messages=[{{"role": "user", "content": "Say hello"}}])
print(r.choices[0].message.content)
EOF

The tiergate command is in .venv: activate it (. .venv/bin/activate) or run .venv/bin/tiergate.
""")
    typer.echo(_dashboard_note(host, port, admin_key_env) + "\n")


def refuse_broken_config(settings: Any) -> None:
    """Exit 2 naming each missing file (absolute paths) a config's requests would need
    (``Settings.startup_problems``), rather than start and answer 502s."""
    problems = settings.startup_problems()
    if problems:
        typer.echo("cannot start: " + "\n  ".join(["the config refers to files that are not there:", *problems]),
                   err=True)
        raise typer.Exit(2)


def unshared_counters_refusal(settings: Settings, workers: int) -> str | None:
    """Why ``--workers N`` must not start, or None. Without Redis, budget counters, holds and rate
    limits live in each process's memory: N uvicorn workers would each enforce the whole budget
    and could spend N times it. Any tenant may be given a budget at any time (admin API, CLI), so
    several workers without Redis are refused outright."""
    if workers <= 1 or settings.redis.resolved_url():
        return None
    return (f"tiergate serve --workers {workers} refused: budgets and rate limits are shared between "
            f"worker processes only through Redis (set ${settings.redis.url_env}). Without it each of the "
            f"{workers} workers would keep its own counters and together they could spend {workers}x a "
            "budget. Set Redis, or run --workers 1 (scale out with replicas that share Redis).")


def register(app: typer.Typer) -> None:
    """Attach the `serve` command to the root app."""

    @app.command()
    def serve(config: Path | None = ConfigOption,
              host: str | None = typer.Option(None, help="Bind address (default: server.host)."),
              port: int | None = typer.Option(None, help="Port (default: server.port)."),
              workers: int = typer.Option(1, min=1, help="uvicorn worker processes."),
              demo: bool = typer.Option(False, "--demo", help="Create a demo tenant+key and print examples."),
              access_log: bool = typer.Option(False, "--access-log", help="Log one line per request."),
              ) -> None:
        """Run the gateway."""
        from gateway.settings import ConfigError, load_settings
        from gateway.web.serving import run, uvicorn_config

        try:
            settings = load_settings(config)
        except ConfigError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
        refuse_broken_config(settings)
        refusal = unshared_counters_refusal(settings, workers)
        if refusal is not None:
            typer.echo(refusal, err=True)
            raise typer.Exit(2)
        if config is not None:
            os.environ["TIERGATE_CONFIG"] = str(config.resolve())
        bind_host, bind_port = host or settings.server.host, port or settings.server.port
        if demo:
            _print_demo(bind_host, bind_port, _demo_key(config), settings.server.admin_key_env)
        uv_config = uvicorn_config(settings, app="gateway.cli.serve:app_from_env", host=bind_host, port=bind_port,
                                   workers=workers, access_log=access_log)
        metrics_cfg = settings.observability.metrics
        if workers == 1 or not metrics_cfg.enabled:
            run(uv_config)
            return
        from gateway.telemetry import metrics

        # Several workers: each writes its samples to a directory they share, and a scrape
        # answered by any of them merges them all. Set before the workers start (they inherit it).
        directory = metrics.prepare_multiprocess(metrics_cfg.multiprocess_dir)
        # The separate metrics port, if any, is this supervising process's: it outlives any worker.
        stop = (metrics.serve_port(metrics_cfg.address, metrics_cfg.port) if metrics_cfg.port is not None
                else (lambda: None))
        try:
            run(uv_config)
        finally:
            stop()
            metrics.cleanup_multiprocess(directory, metrics_cfg.multiprocess_dir)
