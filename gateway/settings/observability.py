"""Metrics, traces and logs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.settings.base import _Strict


class MetricsSettings(_Strict):
    """Prometheus metrics at ``GET /metrics``. ``auth: admin``: the scrape sends the admin key
    (``Authorization: Bearer``, as the admin API); ``none``: open, for a port only the scraper
    reaches. ``tenant_label``: per-tenant token and cost series too (one series per tenant: off
    by default to bound cardinality). ``multiprocess_dir``: where ``tiergate serve --workers N``
    keeps the workers' samples (emptied at start; default a fresh temporary directory per run).
    ``port``: a separate listener (on ``address``) with the same samples and no authentication,
    for a port only the scraper can reach (served by the supervising process under several
    workers; the scrape-time database and engine gauges are on ``/metrics`` only)."""

    enabled: bool = True
    auth: Literal["admin", "none"] = "admin"
    tenant_label: bool = False
    multiprocess_dir: str | None = None
    port: int | None = Field(None, ge=1, le=65535)  # also serve the exposition here, unauthenticated
    address: str = "127.0.0.1"  # where ``port`` listens


class TracingSettings(_Strict):
    """OpenTelemetry traces, off by default. ``exporter: otlp`` sends OTLP/HTTP to ``endpoint``
    (default: the ``OTEL_EXPORTER_OTLP_ENDPOINT`` convention, else localhost:4318);
    ``capture_content``: put prompt and completion text on spans (never, unless set);
    ``sample_ratio``: the share of new traces recorded (parent-based: a client's sampled flag is
    followed). 0.1 by default: at 1.0 metrics + tracing cost ~10% of a CPU-bound gateway's
    instructions per request, at 0.1 ~6% (``tiergate bench obs-instructions``, README)."""

    enabled: bool = False
    exporter: Literal["otlp", "console", "none"] = "otlp"
    endpoint: str | None = None
    service_name: str = "tiergate"
    sample_ratio: float = Field(0.1, ge=0, le=1)
    capture_content: bool = False


class LogSettings(_Strict):
    """``format: json``: one JSON object per line (request id, tenant, tier, status, latency on
    the per-request line; never keys or content)."""

    format: Literal["text", "json"] = "text"
    request_lines: bool = False  # one line per finished request (JSON or text)


class ObservabilitySettings(_Strict):
    metrics: MetricsSettings = MetricsSettings()
    tracing: TracingSettings = TracingSettings()
    logs: LogSettings = LogSettings()
