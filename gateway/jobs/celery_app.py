"""The Celery application of ``jobs.backend: celery``, built by ``make_celery(settings)`` (never at
import time). The broker URL comes from the environment variable ``jobs.broker_url_env``, else
the Redis URL. Tasks are acknowledged late and re-queued when a worker process is lost, so a
killed worker's chunk is picked up again by another; lines never run twice because each line
is claimed in the database (see gateway.jobs.store). The gateway sends one ``RUN_CHUNK`` task per
chunk of a batch's lines (``enqueue_batch``), so every worker on the queue works on one batch; a
worker process registers the task bodies (``gateway.worker.register_tasks``). ``consumers``
tells whether any worker is there to take them. Imports celery only.
"""

from __future__ import annotations

from celery import Celery

from gateway.settings import ConfigError, Settings

RUN_BATCH = "tiergate.run_batch"  # one task for a whole batch (what older gateways send)
RUN_CHUNK = "tiergate.run_chunk"  # (batch_id, first line_no, last line_no): one chunk of a batch


def make_celery(settings: Settings) -> Celery:
    broker = settings.jobs.resolved_broker_url(settings.redis)
    if not broker:
        raise ConfigError(f"jobs.backend is celery but neither ${settings.jobs.broker_url_env} nor "
                          f"${settings.redis.url_env} names a broker")
    app = Celery("tiergate", broker=broker, set_as_current=False)
    app.conf.update(
        task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        task_serializer="json", accept_content=["json"], task_ignore_result=True,
        worker_hijack_root_logger=False, task_default_queue=settings.jobs.queue,
        # A broker restart: a worker keeps retrying (at start-up too) however long the broker is
        # away (Celery's default gives up after 100 tries, then the worker exits); the chunks it
        # is running finish (their lines are claimed in the database, so the copy of the task the
        # broker delivers again only joins in), rather than being cut mid-call.
        broker_connection_retry_on_startup=True, broker_connection_retry=True,
        broker_connection_max_retries=None, worker_cancel_long_running_tasks_on_connection_loss=False,
        # RabbitMQ: a published task counts as sent only once the broker confirmed it (it is
        # then on the durable queue and survives a broker restart)
        broker_transport_options={"confirm_publish": True},
        # a broker that is down fails send_task after ~0.6 s instead of blocking the request
        task_publish_retry_policy={"max_retries": 3, "interval_start": 0, "interval_step": 0.2,
                                   "interval_max": 0.2},
    )

    return app


def consumers(app: Celery, queue: str, *, timeout_s: float = 1.0) -> int:
    """How many workers are there to take ``queue``'s tasks. On an AMQP broker (RabbitMQ): the
    queue's consumer count, exact and immediate (0 when the queue does not exist). On another
    broker (Redis): the workers that answer a broadcast ``active_queues`` within ``timeout_s``
    naming ``queue``. Raises what the broker raises when it cannot be reached."""
    with app.connection_for_write() as conn:
        if conn.transport.driver_type == "amqp":
            try:
                return int(conn.default_channel.queue_declare(queue=queue, passive=True).consumer_count)
            except conn.channel_errors:  # NOT_FOUND: no one ever declared the queue
                return 0
    replies = app.control.inspect(timeout=timeout_s).active_queues() or {}
    return sum(1 for queues in replies.values() if any(q.get("name") == queue for q in queues or []))
