"""Typed configuration: config.yaml plus environment, parsed once.

Secrets are never stored in config.yaml; fields ending in ``_env`` name the
environment variable that holds them. Must not import anything from the gateway
besides its own errors and ``gateway.money`` (it sits below every other module).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.money import TokenCounts, rate, round_nanos

TIER_NAMES: tuple[str, ...] = ("none", "minimal", "low", "medium", "high", "xhigh")
Tier = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
DEFAULT_CONFIG_ENV = "TIERGATE_CONFIG"


class ConfigError(Exception):
    """config.yaml is missing, malformed or names an invalid field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


class Price(_Strict):
    """USD per one million tokens (as configured); costs come out in integer nano-USD."""

    input: float = Field(0.0, ge=0)
    cached_input: float | None = Field(None, ge=0)
    output: float = Field(0.0, ge=0)

    def nanos(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """What these tokens cost, in nano-USD. Each count is multiplied by its price as the
        exact decimal it was configured as (``gateway.money.rate``), the products are summed
        exactly, and the sum is rounded once, half-up, to a whole nano-USD. Cached tokens are
        part of ``prompt_tokens`` and cost ``cached_input`` (``input`` when unset)."""
        cached_price = self.input if self.cached_input is None else self.cached_input
        uncached = max(prompt_tokens - cached_tokens, 0)
        return round_nanos(uncached * rate(self.input) + cached_tokens * rate(cached_price)
                           + completion_tokens * rate(self.output))

    def cost_nanos(self, usage: TokenCounts) -> int:
        """The cost of one call's ``usage`` in nano-USD (see ``nanos``)."""
        return self.nanos(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)


SpeculativeMode = Literal["off", "auto", "prompt_lookup", "draft", "self"]


class EngineKnobs(_Strict):
    experts_per_token: int | None = Field(None, ge=1)
    thinking_budget_tokens: int | None = Field(None, ge=0)
    # speculative decoding for this tier on the bundled engine (None: the engine's default, off);
    # a request's ``tiergate.speculative`` overrides it. draft needs the model's ``draft_model``.
    speculative: SpeculativeMode | None = None


class ModelEngineSettings(_Strict):
    """How the bundled engine loads a ``provider: local`` model. ``quantization``: the weight format of its
    matrices, applied at load from a bf16/fp32 checkpoint (``q8_0``: int8, ``q4_0``: 4-bit, in 32-element
    blocks with a scale each, run on the engine's int8 kernels; ``none``: as stored). A GGUF file's Q8_0/Q4_0
    tensors are used as they are whatever this says."""

    quantization: Literal["none", "q8_0", "q4_0"] = "none"


class ModelSettings(_Strict):
    """One upstream model. ``provider``: openai (any OpenAI-compatible server),
    litellm (any litellm provider string), local (the bundled engine)."""

    provider: Literal["openai", "litellm", "local"]
    model: str = Field(..., min_length=1, description="upstream model name / litellm string / local dir")
    api_base: str | None = None
    api_key_env: str | None = None
    timeout_s: float = Field(120.0, gt=0)
    max_retries: int = Field(2, ge=0, le=10)
    context_window: int = Field(8192, gt=0)
    price: Price = Price()
    # Output cap for this model when it is called by its own name (a tier's max_output_tokens
    # applies when it serves a tier); None: the upstream's own limit, and budget holds assume
    # the whole context window.
    max_output_tokens: int | None = Field(None, gt=0)
    # Non-OpenAI sampling parameters the upstream accepts (vLLM/SGLang do): forwarded when a
    # client sends them; refused with a 400 for models that do not list them.
    extra_params: tuple[Literal["top_k", "min_p", "repetition_penalty"], ...] = ()
    # Let clients send http(s) image URLs, which the upstream (or litellm, on this host) fetches.
    # Off: images must be inline data: URLs (a URL could point into the operator's network).
    remote_media: bool = False
    # provider local: a draft model directory (same tokenizer) for speculative decoding with ``draft``
    draft_model: str | None = Field(None, min_length=1)
    # provider local: the KV cache's element type; int8 stores K/V rows as int8 with a scale per row
    # (about 3.6x the context per byte at head_dim 32; small quantization error)
    kv_dtype: Literal["auto", "int8"] = "auto"
    # provider: local only: how the engine loads the weights (ModelEngineSettings)
    engine: ModelEngineSettings = ModelEngineSettings()

    @model_validator(mode="after")
    def _needs_base(self) -> ModelSettings:
        if self.provider == "openai" and not self.api_base:
            raise ValueError("provider 'openai' needs api_base")
        return self

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class TierSettings(_Strict):
    model: str
    fallbacks: tuple[str, ...] = ()
    price: Price | None = None  # overrides the model's price for this tier
    engine: EngineKnobs = EngineKnobs()
    max_output_tokens: int = Field(1024, gt=0)


class BudgetDefaults(_Strict):
    period: Literal["day", "week", "month", "total"] = "month"
    limit_usd: float | None = Field(None, ge=0)
    soft_limit_fraction: float = Field(0.8, gt=0, le=1)
    alert_thresholds: tuple[float, ...] = (0.5, 0.8, 1.0)
    soft_effort_cap: Tier = "medium"
    reservation_lease_s: float = Field(300.0, gt=0)
    alert_webhook_env: str | None = None
    requests_per_min: int | None = Field(None, gt=0)  # per-tenant default rate limits
    tokens_per_min: int | None = Field(None, gt=0)
    # While Redis is unreachable (gateway/budgets/outage.py): fail_closed refuses what needs the
    # shared counters with a 503 + retry-after; fail_open_to_local counts in each replica, which
    # enforces redis_outage_local_share of every limit (1/N with N replicas: no joint overshoot).
    redis_outage: Literal["fail_closed", "fail_open_to_local"] = "fail_closed"
    redis_outage_local_share: float = Field(1.0, gt=0, le=1)


class RoutingSettings(_Strict):
    """How ``model: "auto"`` is routed and learned (README "Routing on outcomes").

    ``default_tier``: used when no ``reasoning_effort`` is given and no classifier is loaded.
    ``exploration``: the share of classifier-routed requests sent to a uniformly random tier
    instead (billed as usual, recorded with ``effort_source: exploration`` and the propensity of
    the tier that ran); a tenant's own share (``tiergate tenants set --exploration``) wins.
    ``decision_log``: which decisions are stored with their hashed features for learning.
    ``learn_*``: the off-policy learner (``tiergate routing learn``): the held-back share of new
    outcomes its update must not score worse on, the least number of new outcomes per update,
    the step size of per-tenant corrections (0: one global router)."""

    default_tier: Tier = "low"
    # A target for the thresholds instead of classifier.target_mix's strong share: keep at least
    # this share of the all-strong quality (measured on outcomes), or spend at most this share of
    # the all-strong cost. Per tenant: tiergate tenants set --target-quality / --target-cost.
    target_quality: float | None = Field(None, gt=0, le=1)
    target_cost: float | None = Field(None, gt=0, le=1)
    exploration: float = Field(0.02, ge=0, le=1)
    decision_log: Literal["all", "explored", "none"] = "all"
    learn_holdback: float = Field(0.2, gt=0, lt=1)
    learn_min_records: int = Field(200, ge=10)
    tenant_adaptation: float = Field(0.05, ge=0, le=1)

    @model_validator(mode="after")
    def _one_target(self) -> RoutingSettings:
        if self.target_quality is not None and self.target_cost is not None:
            raise ValueError("set routing.target_quality or routing.target_cost, not both")
        return self


CLASSIFIER_CURRENT_NAME = "effort.skops"  # the learner's published artifact, in ``classifier.feedback_dir``
INSTALL_ROOT = Path(__file__).resolve().parents[1]  # the tiergate checkout: engine/models, classifier/artifacts


class ClassifierSettings(_Strict):
    artifact: str = "classifier/artifacts/effort.skops"
    feedback_dir: str = "var/classifier"
    # true: `tiergate serve` / `worker` refuse to start without an artifact (the shipped config.yaml);
    # false: model "auto" without one routes to routing.default_tier (a warning at start)
    required: bool = False
    target_mix: dict[str, float] = {"low": 0.70, "medium": 0.20, "high": 0.10}
    store_prompt_text: bool = False
    reload_interval_s: float = Field(5.0, gt=0)


class PipelineSettings(_Strict):
    max_review_rounds: int = Field(2, ge=0)
    xhigh_paths: int = Field(3, ge=1)
    prune_after_tokens: int = Field(32, ge=1)
    max_steps: int = Field(6, ge=1)
    # When the planner gives no valid plan even after one repair: answer directly on the high tier
    # ("direct"), or run the whole request as one step so plan/execute/review still run ("single_step").
    plan_fallback: Literal["direct", "single_step"] = "direct"


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


class Settings(_Strict):
    server: ServerSettings = ServerSettings()
    database: DatabaseSettings = DatabaseSettings()
    redis: RedisSettings = RedisSettings()
    ledger: LedgerSettings = LedgerSettings()
    models: dict[str, ModelSettings]
    tiers: dict[Tier, TierSettings]
    budgets: BudgetDefaults = BudgetDefaults()
    routing: RoutingSettings = RoutingSettings()
    classifier: ClassifierSettings = ClassifierSettings()
    pipeline: PipelineSettings = PipelineSettings()
    jobs: JobsSettings = JobsSettings()
    observability: ObservabilitySettings = ObservabilitySettings()
    base_dir: str = "."

    @field_validator("tiers")
    @classmethod
    def _all_tiers(cls, tiers: dict[str, TierSettings]) -> dict[str, TierSettings]:
        missing = [t for t in TIER_NAMES if t not in tiers]
        if missing:
            raise ValueError(f"missing tiers: {', '.join(missing)}")
        return tiers

    @model_validator(mode="after")
    def _tier_models_exist(self) -> Settings:
        for name, tier in self.tiers.items():
            for model in (tier.model, *tier.fallbacks):
                if model not in self.models:
                    raise ValueError(f"tiers.{name}: unknown model {model!r} (not under models:)")
            target = self.models[tier.model]
            if tier.engine.speculative == "draft" and target.provider == "local" and target.draft_model is None:
                raise ValueError(f"tiers.{name}: engine.speculative 'draft' needs models.{tier.model}.draft_model")
        return self

    def tier_price(self, tier: str) -> Price:
        t = self.tiers[tier]  # type: ignore[index]
        return t.price or self.models[t.model].price

    def resolve_path(self, path: str) -> Path:
        """``path`` as given when absolute, else relative to the config file's folder (``base_dir``),
        whatever the current directory."""
        p = Path(path)
        return p if p.is_absolute() else Path(self.base_dir) / p

    def asset_paths(self, path: str) -> list[Path]:
        """Where a read-only file the config names (a local model directory, the classifier
        artifact) is looked for, in order: relative to the config file's folder, then — for a
        relative path — in the tiergate installation, where the bundled demo model and
        classifier live (so a copied config.yaml still finds them). Absolute paths."""
        p = Path(path)
        if p.is_absolute():
            return [p]
        beside = (Path(self.base_dir) / p).resolve()
        bundled = (INSTALL_ROOT / p).resolve()
        return [beside] if bundled == beside else [beside, bundled]

    def resolve_asset(self, path: str) -> Path:
        """The first of ``asset_paths`` that exists (the config-relative one when none does)."""
        paths = self.asset_paths(path)
        return next((x for x in paths if x.exists()), paths[0])

    def classifier_artifact_paths(self) -> list[Path]:
        """The shipped artifact's candidates: ``asset_paths`` when ``classifier.artifact`` is
        written in the config, else only beside the config file (a config that names no artifact
        does not pick up the bundled one)."""
        if "artifact" in self.classifier.model_fields_set:
            return self.asset_paths(self.classifier.artifact)
        return [self.resolve_path(self.classifier.artifact).resolve()]

    def startup_problems(self) -> list[str]:
        """What would make this config fail its first requests, each naming the absolute path:
        a local model directory (of a model some tier uses) without config.json, and, when
        ``classifier.required``, no classifier artifact. Checked by `tiergate serve` and
        `tiergate worker` before they start."""
        problems = []
        used = dict.fromkeys(m for t in self.tiers.values() for m in (t.model, *t.fallbacks))
        for name in used:
            model = self.models[name]
            if model.provider == "local":
                paths = self.asset_paths(model.model)
                if not any((p / "config.json").is_file() or (p.suffix == ".gguf" and p.is_file()) for p in paths):
                    problems.append(f"models.{name}: no local model directory with a config.json (or .gguf file) "
                                    f"at {' or '.join(map(str, paths))}")
                if model.draft_model is not None:
                    drafts = self.asset_paths(model.draft_model)
                    if not any((p / "config.json").is_file() for p in drafts):
                        problems.append(f"models.{name}.draft_model: no model directory with a config.json at "
                                        f"{' or '.join(map(str, drafts))}")
        if self.classifier.required:
            paths = [self.resolve_path(self.classifier.feedback_dir).resolve() / CLASSIFIER_CURRENT_NAME,
                     *self.classifier_artifact_paths()]
            if not any(p.is_file() for p in paths):
                problems.append(f"classifier.artifact: no classifier artifact at {' or '.join(map(str, paths))} "
                                "(classifier.required is true; train one with `tiergate classifier train`, or set "
                                "required: false to route model 'auto' to routing.default_tier)")
        return problems


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(part) for part in e["loc"])
        lines.append(f"  {loc or '<root>'}: {e['msg']}")
    return "invalid config:\n" + "\n".join(lines)


def settings_from_dict(data: dict[str, Any], base_dir: str | Path = ".") -> Settings:
    try:
        return Settings.model_validate({**data, "base_dir": str(base_dir)})
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_settings(path: str | Path | None = None) -> Settings:
    """Load and validate config.yaml (``$TIERGATE_CONFIG`` or ./config.yaml)."""
    path = Path(path or os.environ.get(DEFAULT_CONFIG_ENV) or "config.yaml")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must be a mapping")
    return settings_from_dict(raw, base_dir=path.resolve().parent)
