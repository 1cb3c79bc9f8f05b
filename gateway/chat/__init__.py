"""The chat request path: from a validated body to an answer, a ledger row per upstream call,
settled budgets and a request record.

- ``flow.ChatFlow``: prepare (allow-list, the one ``RouteDecision`` from gateway.routing, context
  window) → admit → execute → settle → record; ``sse.ChatStream`` for streamed answers.
- ``admission``: rate limits and budget holds sized on the decision, settled to the ledger rows.
- ``direct`` / ``pipelined``: the executors; they return a ``Completion`` or a ``SpendStream``
  (``spend``: ``Spend``, ``Completion``, the stream close contract, ``RequestRows``).
- ``disconnect``: racing the work against the client's disconnect.
- ``wiring.build_flow``: the flow for the live route or a batch runner.

Nothing is imported here; import the modules. Must not import FastAPI, Starlette or Celery.
"""
