"""Observability: Prometheus metrics (``metrics``), OpenTelemetry traces (``tracing``, with the
sampling decision it takes ahead of the SDK in ``trace_sampling``) and structured request logs
(``logs``).

Plain modules any layer may use: they import settings, prometheus_client and opentelemetry,
never another gateway layer (the scrape-time database collectors live in ``collectors``, which
only the ``/metrics`` route imports).
"""
