"""`tiergate worker`: a Celery worker for batch jobs (``jobs.backend: celery``), built from
config.yaml by ``gateway.jobs.celery_app.make_celery`` with ``gateway.worker``'s task body. Nothing heavy is imported until it runs."""

from __future__ import annotations

from pathlib import Path

import typer

ConfigOption = typer.Option(None, "--config", "-c", envvar="TIERGATE_CONFIG", help="Path to config.yaml.")


def register(app: typer.Typer) -> None:
    @app.command()
    def worker(config: Path | None = ConfigOption,
               concurrency: int = typer.Option(1, min=1, help="Worker processes (each runs jobs.concurrency lines)."),
               loglevel: str = typer.Option("info", help="Celery log level."),
               hostname: str | None = typer.Option(None, help="Celery node name (default: celery@<host>).")) -> None:
        """Run a Celery worker that executes batch jobs."""
        from gateway.cli.serve import refuse_broken_config
        from gateway.jobs.celery_app import make_celery
        from gateway.settings import ConfigError, load_settings
        from gateway.worker import register_tasks

        try:
            settings = load_settings(config)
            refuse_broken_config(settings)
            celery = make_celery(settings)
            register_tasks(celery, settings)
        except ConfigError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
        argv = ["worker", f"--concurrency={concurrency}", f"--loglevel={loglevel}", "--without-gossip",
                "--without-mingle", "--without-heartbeat"]
        if hostname:
            argv.append(f"--hostname={hostname}")
        celery.worker_main(argv)
