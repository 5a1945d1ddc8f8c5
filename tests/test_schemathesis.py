"""Schemathesis fuzzes every operation of the live server's OpenAPI schema (/openapi.json) with
valid (positive) and invalid (negative) requests: none may get a 5xx, and every error is in the
OpenAI shape (Anthropic's under /v1/messages). Response conformance to the schema is not
checked: it does not declare every 4xx.

The server's context is 64 tokens, so a generated request that is accepted generates little.
schemathesis.pytest.from_fixture cannot run under pytest >= 9.2 (schemathesis 4.32 sets the
removed `Item._nodeid`), so each operation's case strategy is driven by hypothesis here."""

from __future__ import annotations

import json
from collections import Counter

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode

from tests.bad_inputs import MAX_MODEL_LEN, check_error
from tests.conftest import write_model
from tests.server_utils import running_server

# Per mode: hypothesis examples per operation (an operation without parameters needs far fewer),
# and the requests the mode must send at least: 1,000 in all. A valid request generates (up to
# n x prompts x the context), 0.2-0.5 s here; an invalid one costs ~10 ms.
MAX_EXAMPLES = {GenerationMode.POSITIVE: 90, GenerationMode.NEGATIVE: 220}
MIN_REQUESTS = {GenerationMode.POSITIVE: 300, GenerationMode.NEGATIVE: 800}
REQUEST_GUARD_S = 120.0  # a hang guard on one request: far above what any case takes


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    model = write_model(tmp_path_factory.mktemp("fuzz"), "llama")
    with running_server(model, max_model_len=MAX_MODEL_LEN, cpu_kernels=False) as server:
        yield schemathesis.openapi.from_url(f"{server.url}/openapi.json", timeout=REQUEST_GUARD_S)


def check(case: Case) -> None:
    response = case.call(timeout=REQUEST_GUARD_S)
    assert response.status_code < 500, response.text[:300]
    if response.status_code >= 400:
        content_type = response.headers.get("content-type", [""])[0]
        assert content_type.startswith("application/json"), response.headers
        body = json.loads(response.text)
        if case.path.startswith("/v1/messages"):  # Anthropic's shape
            assert body["type"] == "error" and body["error"]["message"], body
        else:
            check_error(body)


@pytest.mark.parametrize("mode", list(MAX_EXAMPLES))
def test_fuzzed_requests_get_no_5xx_and_openai_errors(api_schema, mode):
    sent: Counter[str] = Counter()
    failures = []
    fuzz_settings = settings(
        max_examples=MAX_EXAMPLES[mode],
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as found
        suppress_health_check=list(HealthCheck),
    )
    for result in api_schema.get_all_operations():  # bounded by count: operations x examples
        operation = result.ok()

        @fuzz_settings
        @given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case: Case) -> None:
            sent[case.operation.label] += 1
            check(case)

        try:
            fuzz()
        except hypothesis.errors.Unsatisfiable:
            continue  # no invalid request exists (a GET without parameters)
        except Exception as exc:  # one operation's failure does not hide another's
            failures.append(f"{operation.label}: {type(exc).__name__}: {exc}")
    print(f"{mode}: {sum(sent.values())} requests", dict(sent))  # shown with -s
    assert not failures, "\n".join(failures)
    assert sum(sent.values()) >= MIN_REQUESTS[mode], dict(sent)
