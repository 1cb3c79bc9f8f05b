"""The chat request path: from a validated body to an answer, a ledger row per upstream call,
settled budgets and a request record.

- ``flow.ChatFlow``: prepare (allow-list, the one ``RouteDecision`` from gateway.routing, context
  window) → admit → execute → settle → record; ``sse.ChatStream`` for streamed answers; the
  work races the client's disconnect (``flow.unless_gone``).
- ``admission``: rate limits and budget holds sized on the decision, settled to the ledger rows.
- ``direct`` / ``pipelined``: the executors; they return a ``Completion`` or a ``SpendStream``
  (``spend``: ``Spend``, ``Completion``, the stream close contract, ``RequestRows``).
- ``wiring.build_flow``: the flow for the live route or a batch runner.

Nothing is imported here; import the modules. Must not import FastAPI, Starlette or Celery.
"""
