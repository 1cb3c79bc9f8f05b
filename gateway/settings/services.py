"""Where tiergate serves and keeps its state: the HTTP server, the database, Redis, the spend
ledger, batch jobs.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, model_validator

from gateway.settings.base import _Strict


class ServerSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    admin_key_env: str = "TIERGATE_ADMIN_KEY"
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    log_level: str = "info"
    # The edge (see README "Server limits"): JSON nesting depth (orjson re-encodes at most 254),
    # the time a client has to send its request line + headers and then its body, idle keep-alive,
    # connections + requests in flight per process before uvicorn answers 503.
    max_json_depth: int = Field(64, ge=2, le=200)
    header_read_timeout_s: float = Field(10.0, gt=0)
    body_read_timeout_s: float = Field(30.0, gt=0)
    keep_alive_timeout_s: int = Field(5, ge=1)
    limit_concurrency: int | None = Field(1024, gt=0)
    # Proxies whose X-Forwarded-For/-Proto uvicorn trusts (client address for throttles and
    # logs); None: uvicorn's default ($FORWARDED_ALLOW_IPS, else 127.0.0.1).
    forwarded_allow_ips: str | None = None
    # A revoked API key is refused by every replica at most this long after the revocation commits.
    key_cache_ttl_s: float = Field(1.0, gt=0, le=60)
    # While the database is unreachable, a key looked up less than this long ago is still
    # accepted from the cache (nothing can be revoked meanwhile); other keys get a 503.
    key_cache_stale_s: float = Field(300.0, ge=0, le=86400)
    # A chat request field tiergate does not know: "reject" (400 naming it, the default) or
    # "drop" (removed before validation; never forwarded either way).
    unknown_fields: Literal["reject", "drop"] = "reject"


class DatabaseSettings(_Strict):
    url_env: str = "TIERGATE_DATABASE_URL"
    default_url: str = "sqlite:///var/tiergate.db"

    def resolved_url(self) -> str:
        return os.environ.get(self.url_env) or self.default_url


class RedisSettings(_Strict):
    url_env: str = "TIERGATE_REDIS_URL"
    key_prefix: str = "tiergate:"  # budget counters / rate limits live under this prefix
    timeout_s: float = Field(2.0, gt=0)  # connect and command timeout: a hung Redis is an outage, not a hang

    def resolved_url(self) -> str | None:
        return os.environ.get(self.url_env) or None


class LedgerSettings(_Strict):
    journal_dir: str = "var/journal"
    # How long journaled rows may wait to be written to the database together (or ``batch_size`` of
    # them). Each batch costs the applier ~2 ms of CPU and PostgreSQL ~1 ms whatever its size, on
    # the cores that serve requests: at 50 ms that fixed cost was a third of the ledger's database
    # work at ~600 requests/s (`tiergate bench ledger`). A caller that waits for rows
    # (``Ledger.flush``: startup, feedback) has them written at once, not after this interval;
    # dashboards and spend summaries see them up to this much later.
    flush_interval_ms: int = Field(200, gt=0)
    batch_size: int = Field(500, gt=0)
    # What a response's last bytes wait for (see gateway/ledger/service.py):
    # process: its ledger rows written to the journal with write(2) — a kill -9 of the gateway
    #   loses nothing; a power loss can lose about one fdatasync interval (fdatasyncs run in the
    #   background, at least 10 ms apart). The default.
    # fsync: its rows fdatasync'd in the journal (survives power loss; ~one fsync of latency).
    # none: no wait; rows are journaled within milliseconds, a kill -9 may lose that window.
    durability: Literal["process", "fsync", "none"] = "process"
    # An upstream call whose gateway (or worker) died mid-call has a journaled intent and no
    # finishing row; the next process on this journal settles it as status ``interrupted``:
    # estimate: its prompt tokens + ``interrupted_output_fraction`` of its output cap;
    # reserved: its prompt tokens + its whole output cap (the worst case its budget hold covered).
    interrupted_billing: Literal["estimate", "reserved"] = "estimate"
    interrupted_output_fraction: float = Field(0.5, ge=0, le=1)
    # Where batches are written to the database: auto = a child process on PostgreSQL (the
    # serving process then does no database work for the ledger), a thread on SQLite.
    applier: Literal["auto", "thread", "process"] = "auto"
    applier_nice: int = Field(10, ge=0, le=19)  # the applier process's niceness: the serving loop first

    @model_validator(mode="before")
    @classmethod
    def _durable_responses_alias(cls, data: Any) -> Any:
        """The older ``durable_responses: bool`` still works: true = fsync, false = none."""
        if not isinstance(data, dict) or "durable_responses" not in data:
            return data
        data = dict(data)
        legacy = data.pop("durable_responses")
        if not isinstance(legacy, bool):
            raise ValueError("ledger.durable_responses must be true or false (prefer ledger.durability)")
        level = "fsync" if legacy else "none"
        if data.setdefault("durability", level) != level:
            raise ValueError(f"ledger.durable_responses={legacy} contradicts ledger.durability="
                             f"{data['durability']!r}; set only ledger.durability")
        return data


class JobsSettings(_Strict):
    """Batch jobs (``/v1/files``, ``/v1/batches``). ``embedded``: an asyncio runner inside each
    gateway process works through the batches (no external server); ``celery``: the gateway
    only enqueues, ``tiergate worker`` processes run the lines (broker URL from ``broker_url_env``,
    else the Redis URL)."""

    backend: Literal["embedded", "celery"] = "embedded"
    broker_url_env: str = "TIERGATE_BROKER_URL"
    queue: str = "tiergate-batches"  # the Celery queue the gateway sends to and workers consume
    concurrency: int = Field(4, ge=1, le=256)  # lines in flight per runner / per worker task
    chunk_lines: int = Field(16, ge=1, le=100_000)  # celery: lines per task (a batch's chunks spread over workers)
    # A running line's lease: extended every third of it while its attempt is alive (heartbeat),
    # so a line whose process died runs again at most this long after that process's last beat.
    line_lease_s: float = Field(30.0, gt=0)
    poll_interval_s: float = Field(1.0, gt=0)
    # celery: how often the gateway tries again to enqueue a batch the broker did not take
    requeue_interval_s: float = Field(5.0, gt=0)
    max_file_bytes: int = Field(100 * 1024 * 1024, gt=0)
    upload_read_timeout_s: float = Field(600.0, gt=0)  # the time an upload's body may take to arrive
    max_lines: int = Field(50_000, ge=1)

    def resolved_broker_url(self, redis: RedisSettings) -> str | None:
        return os.environ.get(self.broker_url_env) or redis.resolved_url()
