"""schemathesis against the server's own OpenAPI document: a bounded, derandomized number of
generated requests per operation (valid and invalid); no 5xx, every status code, content type
and body as the document says. The server has a 96-token context, so every generated request
finishes quickly whatever its ``max_tokens`` and ``n``."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.slow  # fuzzes a server of its own: ~20 s

MAX_EXAMPLES = 25  # per operation
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def small_server(tiny_model_dir, tmp_path_factory, launch_server):
    live = launch_server(tiny_model_dir, tmp_path_factory.mktemp("logs") / "schemathesis.log", "--max-model-len", "96")
    yield live
    assert live.stop() == 0


def test_generated_requests_get_no_5xx_and_match_the_schema(small_server):
    schema = schemathesis.openapi.from_url(small_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {(op.method.upper(), op.path) for op in operations}
    assert {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
            ("GET", "/v1/models")} <= paths
    num_calls = 0
    statuses: dict[str, set[int]] = {op.path: set() for op in operations}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            nonlocal num_calls
            if isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = "tiny"  # a random name is always the 404 tested elsewhere
            response = case.call_and_validate(base_url=small_server.url, checks=CHECKS, timeout=60)
            num_calls += 1
            statuses[case.operation.path].add(response.status_code)

        check()
    assert num_calls >= len(operations) * 5  # something was really generated and sent
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        assert 200 in statuses[path] and 400 in statuses[path], statuses  # both ways through the server
    assert "Traceback" not in small_server.log()
