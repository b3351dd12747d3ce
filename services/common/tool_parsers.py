"""Tool calls in a model's output, by format (vLLM's `--tool-call-parser` names), torch-
and gRPC-free. tool_parser_base.py has the shared rules (content around calls, streaming
equal to whole-text parsing); each format's module its own syntax.

    parser = TOOL_PARSERS["hermes"](request_tools)
    content, deltas = parser.feed(text_delta) ... parser.finish()   # streamed
    content, calls = parser.parse(whole_text)                       # or whole
"""

from __future__ import annotations

from .tool_parser_base import ToolCall, ToolCallDelta, ToolParser, tool_call_id
from .tool_parser_formats import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
)
from .tool_parser_qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}

__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "Qwen3CoderToolParser", "ToolCall", "ToolCallDelta", "ToolParser", "tool_call_id"]
