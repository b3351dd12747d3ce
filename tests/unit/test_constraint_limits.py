"""The bounds on a structured-output constraint (services/common/constraint_limits.py):
size, depth and choice count refused where the constraint is built, so the router
refuses before anything is queued; a schema nested far past what Python's JSON parser
recurses through is refused as bad input (never a RecursionError), over gRPC and HTTP."""

from __future__ import annotations

import json

import grpc
import pytest

from baton.services.common.constraint_limits import (
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    MAX_CONSTRAINT_DEPTH,
)
from baton.services.common.sampling_params import StructuredOutput
from baton.services.rpc.errors import InvalidArgument
from baton.v1 import generation_pb2 as gen
from tests.unit.test_openai_errors import call
from tests.unit.test_structured_api import _job


def nested_schema(depth: int) -> str:
    """A JSON schema `depth` JSON levels deep, as text (a dict this deep could not be
    encoded)."""
    return ('{"type": "array", "items": ' * (depth - 1) + '{"type": "string"}'
            + "}" * (depth - 1))


def test_a_schema_at_the_depth_limit_passes_and_one_past_it_is_refused():
    assert json.loads(nested_schema(MAX_CONSTRAINT_DEPTH))  # the helper's own depth
    StructuredOutput("json", nested_schema(MAX_CONSTRAINT_DEPTH))
    with pytest.raises(ValueError, match=f"json: nested more than {MAX_CONSTRAINT_DEPTH}"):
        StructuredOutput("json", nested_schema(MAX_CONSTRAINT_DEPTH + 1))


def test_depth_counts_brackets_outside_strings_only():
    deep_in_a_string = json.dumps({"description": "[" * 500, "type": "string"})
    StructuredOutput("json", deep_in_a_string)


@pytest.mark.parametrize("text", [nested_schema(2_000), "[" * 30_000 + "]" * 30_000])
def test_a_schema_deeper_than_the_parser_recurses_is_a_value_error(text):
    with pytest.raises(ValueError, match="nested more than"):
        StructuredOutput("json", text)


@pytest.mark.parametrize("kind, deep, shallow", [
    ("regex", "(" * 65 + "a" + ")" * 65, r"\(" * 65 + "[(]" * 65 + "(a)"),
    ("grammar", "root ::= " + "(" * 65 + '"a"' + ")" * 65,
     'root ::= "' + "(" * 200 + '" ([(] | "b")'),
])
def test_groups_nest_at_most_to_the_limit_escapes_strings_and_classes_aside(kind, deep,
                                                                           shallow):
    with pytest.raises(ValueError, match=f"{kind}: nested more than 64"):
        StructuredOutput(kind, deep)
    StructuredOutput(kind, shallow)


def test_size_and_choice_count_are_bounded():
    with pytest.raises(ValueError, match=f"regex: {MAX_CONSTRAINT_CHARS + 1} characters, "
                                         "over the limit"):
        StructuredOutput("regex", "a" * (MAX_CONSTRAINT_CHARS + 1))
    StructuredOutput("choice", choices=tuple(f"c{i}" for i in range(MAX_CHOICES)))
    with pytest.raises(ValueError, match=f"choice: {MAX_CHOICES + 1} choices, over"):
        StructuredOutput("choice", choices=tuple(f"c{i}" for i in range(MAX_CHOICES + 1)))
    with pytest.raises(ValueError, match="choice: .* characters, over the limit"):
        StructuredOutput("choice", choices=("x" * MAX_CONSTRAINT_CHARS, "y"))


def test_the_router_refuses_a_deep_schema_over_grpc_as_invalid_argument():
    with pytest.raises(InvalidArgument) as e:
        _job(gen.StructuredOutput(json_schema=nested_schema(2_000)))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling: structured output json: nested more than" in str(e.value)


@pytest.mark.parametrize("depth, param", [
    (100, "response_format"),  # parsed, then refused by the constraint's own bound
    (900, "response_format"),  # near the parser's recursion limit: still never encoded
    (2_000, None),  # past what the parser takes at all: refused while parsing
])
def test_over_http_a_deep_schema_is_a_400_in_openais_shape(depth, param):
    body = ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
            '"response_format": {"type": "json_schema", "json_schema": {"name": "x", '
            f'"schema": {nested_schema(depth)}}}}}}}')
    got = call("POST", "/v1/chat/completions", content=body,
               headers={"content-type": "application/json"})
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and "nested" in error["message"]
    if param is not None:
        assert error["param"] == param
