"""schemathesis over the served OpenAPI document of the ``/v1`` surface, against a real gateway
under uvicorn (scripted upstream, SQLite, real ledger): valid and invalid requests generated
from the very models the routes validate with. No response may be a 5xx, and every response's
status, content type and body must be what the document says. Bounded: a fixed number of
examples per operation, derandomized (the same cases every run), a deadline per run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.gateway.gateway_harness import served_gateway
from tests.gateway.scripted_upstream import ScriptedUpstream

pytestmark = [pytest.mark.slow, pytest.mark.integration]
EXAMPLES = 40
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_served_schema_documents_the_v1_surface(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    with served_gateway(tmp_path, upstream) as (base, _):
        doc = httpx.get(base.removesuffix("/v1") + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/models", "/v1/files", "/v1/batches", "/v1/feedback"} <= set(doc["paths"])
    req = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert req["additionalProperties"] is False and "fallbacks" not in req["properties"]


def test_schemathesis_finds_no_5xx_and_no_schema_violation(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    with served_gateway(tmp_path, upstream) as (base, gw):
        root = base.removesuffix("/v1")
        schema = schemathesis.openapi.from_url(root + "/openapi.json")
        headers = {"Authorization": f"Bearer {gw.key}"}
        failures: list[str] = []
        seen: dict[str, set[int]] = {}
        def fuzz(operation: Any) -> None:
            label = operation.label
            strategy = st.one_of(operation.as_strategy(),
                                 operation.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE))

            @given(case=strategy)
            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case: Any) -> None:
                response = case.call(base_url=root, headers=headers, timeout=30)
                seen.setdefault(label, set()).add(response.status_code)
                try:
                    case.validate_response(response, checks=CHECKS)
                except Exception as err:  # collect every operation's failures, then report them together
                    failures.append(f"{label}: {type(err).__name__}: {str(err)[:600]}")

            run()

        for result in schema.get_all_operations():
            fuzz(result.ok())
    assert not failures, "\n\n".join(failures[:10])
    assert all(code < 500 for codes in seen.values() for code in codes), seen
    assert len(seen) >= 12 and any(200 in codes for codes in seen.values()), seen
