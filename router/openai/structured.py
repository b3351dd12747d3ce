"""Structured output (guided decoding) as OpenAI and vLLM clients ask for it, as one
StructuredOutput: OpenAI's `response_format`, vLLM's older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, and its newer `structured_outputs` object. At most one
constraint per request; a malformed one is refused (InvalidArgument naming the field,
"field: ..." as render.param_of reads it), as is any option the engine cannot honour."""

from __future__ import annotations

import json

from baton.services.common import constraint_limits
from baton.services.common.errors import shown
from baton.services.common.sampling_params import StructuredOutput
from baton.services.rpc.errors import InvalidArgument

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
# structured_outputs' constraint keys, as vLLM's StructuredOutputsParams names them.
KEYS = ("json", "regex", "choice", "grammar", "json_object")
# Its options that change the output, which the engine does not implement.
REFUSED_OPTIONS = ("structural_tag", "whitespace_pattern", "disable_any_whitespace",
                   "disable_additional_properties")


def structured_output(extra: dict) -> StructuredOutput | None:
    """The one constraint the request body's (extra) fields ask for, or None."""
    if extra.get("guided_whitespace_pattern") is not None:
        raise InvalidArgument("guided_whitespace_pattern: not supported")
    found: list[tuple[str, StructuredOutput]] = []
    if extra.get("response_format") is not None:
        so = _response_format(extra["response_format"])
        if so is not None:
            found.append(("response_format", so))
    for name, kind in GUIDED.items():
        if extra.get(name) is not None:
            found.append((name, _make(name, kind, extra[name])))
    if extra.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(extra["structured_outputs"])))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise InvalidArgument(f"{names[1]}: only one structured output constraint per "
                              f"request, got {' and '.join(names)}")
    return found[0][1] if found else None


def _response_format(value) -> StructuredOutput | None:
    field = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidArgument(f"{field}: must be an object with a type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise InvalidArgument(f"{field}: type must be 'text', 'json_object' or "
                              f"'json_schema', got {shown(kind)}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidArgument(f"{field}: type 'json_schema' needs a json_schema object "
                              "(name, schema, strict)")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidArgument(f"{field}: json_schema.schema must be a JSON schema object, "
                              f"got {shown(schema)}")
    if spec.get("name") is not None and not isinstance(spec["name"], str):
        raise InvalidArgument(f"{field}: json_schema.name must be a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidArgument(f"{field}: json_schema.strict must be a boolean")
    return _make(field, "json", schema)


def _structured_outputs(value) -> StructuredOutput:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidArgument(f"{field}: must be an object")
    for key in REFUSED_OPTIONS:
        if value.get(key):
            raise InvalidArgument(f"{field}: {key} is not supported")
    unknown = sorted(set(value) - set(KEYS) - set(REFUSED_OPTIONS) - {"disable_fallback"})
    if unknown:
        raise InvalidArgument(f"{field}: unknown key {shown(unknown[0])} (one of "
                              f"{', '.join(KEYS)})")
    json_object = value.get("json_object")
    if json_object is not None and not isinstance(json_object, bool):
        raise InvalidArgument(f"{field}: json_object must be a boolean")
    given = [k for k in KEYS if value.get(k) is not None and value.get(k) is not False]
    if len(given) != 1:
        raise InvalidArgument(f"{field}: exactly one of {', '.join(KEYS)} must be set, got "
                              f"{', '.join(given) or 'none'}")
    key = given[0]
    return _make(f"{field}.{key}", key, value[key])


def _make(field: str, kind: str, value) -> StructuredOutput:
    """One constraint from its JSON value: checked here for its JSON type, then by
    StructuredOutput for its content (the engine's own rules)."""
    if kind == "json" and isinstance(value, (dict, bool)):
        try:
            constraint_limits.check_json_value(value)  # before the encoder recurses
        except ValueError as e:
            raise InvalidArgument(f"{field}: {e}") from None
        value = json.dumps(value)
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c
                                                               for c in value):
            raise InvalidArgument(f"{field}: must be a list of one or more non-empty "
                                  f"strings, got {shown(value)}")
        return StructuredOutput("choice", choices=tuple(value))
    if not isinstance(value, str) or not value:
        what = "a JSON schema (an object, or its JSON text)" if kind == "json" else \
            "a non-empty string"
        raise InvalidArgument(f"{field}: must be {what}, got {shown(value)}")
    try:
        return StructuredOutput(kind, value)
    except ValueError as e:
        raise InvalidArgument(f"{field}: {e}") from None
