"""Batch jobs: the OpenAI Files + Batch API's work, run exactly once per line.

- the ``files``, ``batches`` and ``batch_lines`` tables live in ``gateway.db.models`` (``jobs``).
- ``files`` / ``validate`` / ``store``: plain functions on a Session (tenant-scoped files, JSONL
  validation, line claims with leases, fenced finish, cancel, finalize).
- ``capture.AttemptLedger`` and ``batch.BatchWork``: a line through the live chat flow, its call
  rows journaled by the ledger as they happen, its result committed (fenced) afterwards.
- ``runner.BatchRunner``: bounded concurrency over the database (every batch, one, or one chunk
  of one), with a heartbeat that extends its lines' leases; ``backends``: the embedded runner or
  the Celery producer for the app (one task per chunk of lines, a ``no_worker`` note when no
  worker consumes the queue).
- ``celery_app``: the Celery app (built by a factory). A worker process's runtime and task body
  are ``gateway.worker`` (an entry point, above the runtime).

Nothing is imported here: the batch logic must never pull in FastAPI or Celery (import-linter contract).
"""
