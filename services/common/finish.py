"""`FinishReason`: why a request ended, in one vocabulary from the engine to every API.
Torch-free. The wire's enum (services/rpc/convert.py) and OpenAI's names
(router/openai/render.py) are mapped from it at the edges."""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id, a stop string, or the constraint's end
    LENGTH = "length"  # max_tokens, or the model's length
    ABORT = "abort"  # cancelled, deadline, or a failure (the output's `error` says which)
    CONSTRAINT = "constraint"  # the structured-output constraint allows no further token
    TOOL_CALLS = "tool_calls"  # the output called tools (set by the router, never an engine)
