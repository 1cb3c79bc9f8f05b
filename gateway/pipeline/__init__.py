"""The four-layer pipeline: perceive, plan, execute, review. Knows nothing of FastAPI or Celery."""
