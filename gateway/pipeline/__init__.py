"""The four-layer pipeline: perceive, plan, execute, review. Knows nothing of FastAPI or Celery.

Public API: ``Pipeline`` (run / stream), ``PipelineResult``, ``PipelineStream``, the injected
callable types and the records it emits (``StageCall`` for the ledger, ``ReviewVerdict`` for
the classifier's feedback loop).
"""

from gateway.pipeline.accounting import CostCapReached
from gateway.pipeline.plan import Plan, PlanInvalid, PlanStep, parse_plan
from gateway.pipeline.result import PipelineResult
from gateway.pipeline.runner import Pipeline
from gateway.pipeline.stream import PipelineStream
from gateway.pipeline.types import (
    CallModel,
    FeedbackSink,
    LedgerSink,
    RequestContext,
    ReviewVerdict,
    StageCall,
    StreamModel,
)

__all__ = [
    "CallModel", "CostCapReached", "FeedbackSink", "LedgerSink", "Pipeline", "PipelineResult",
    "PipelineStream", "Plan", "PlanInvalid", "PlanStep", "RequestContext", "ReviewVerdict", "StageCall",
    "StreamModel", "parse_plan",
]
