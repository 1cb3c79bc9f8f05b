"""The Celery application of ``jobs.backend: celery``, built by ``make_celery(settings)`` (never at
import time). The broker URL comes from the environment variable ``jobs.broker_url_env``, else
the Redis URL. Tasks are acknowledged late and re-queued when a worker process is lost, so a
killed worker's batch is picked up again; lines never run twice because each line is claimed
in the database (see gateway.jobs.store). The gateway only sends ``RUN_BATCH`` tasks; a worker
process registers the task body too (``gateway.worker.register_tasks``). Imports celery only.
"""

from __future__ import annotations

from celery import Celery

from gateway.settings import ConfigError, Settings

RUN_BATCH = "tiergate.run_batch"


def make_celery(settings: Settings) -> Celery:
    broker = settings.jobs.resolved_broker_url(settings.redis)
    if not broker:
        raise ConfigError(f"jobs.backend is celery but neither ${settings.jobs.broker_url_env} nor "
                          f"${settings.redis.url_env} names a broker")
    app = Celery("tiergate", broker=broker, set_as_current=False)
    app.conf.update(
        task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        task_serializer="json", accept_content=["json"], task_ignore_result=True,
        broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
        task_default_queue=settings.jobs.queue,
        # a broker that is down fails send_task after ~0.6 s instead of blocking the request
        task_publish_retry_policy={"max_retries": 3, "interval_start": 0, "interval_step": 0.2,
                                   "interval_max": 0.2},
    )

    return app
