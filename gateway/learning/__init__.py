"""Routing that learns from outcomes, on the gateway's side of the classifier's public API.

- ``perceive``: the live classifier (hot-reloaded artifact, traffic-calibrated thresholds aimed at
  a tenant's quality or cost target, exploration with propensities) and feedback storage.
- ``outcomes``: the decision log and the outcome rows (feedback, review verdicts, imported files).
- ``learner``: ``tiergate routing learn`` — one incremental off-policy update, promoted only if it
  does not route worse on held-back logged traffic.

Nothing is imported here; import the modules. Must not import FastAPI, Starlette or Celery.
"""
