"""Tool-call text as the models write it, with their exact tags, and what it must parse to:
(parser, text, content, [(name, arguments as Python objects)])."""

from __future__ import annotations


def _fn(name: str, **props) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": f"{name} (test tool)",
        "parameters": {"type": "object", "properties": props}}}


S, INT, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
TOOLS = [
    _fn("get_current_weather", location=S, unit=S, format=S, days=INT),
    _fn("get_current_temperature", location=S),
    _fn("get_temperature_date", location=S, date=S),
    _fn("get_stock_fundamentals", symbol=S),
    _fn("get_time"),
    _fn("send_email", to={"type": "array", "items": S}, subject=S, body=S,
        meta={"type": "object"}),
    _fn("get_current_conditions", location=S, unit=S),
    _fn("search_flights", origin=S, destination=S, passengers=INT, dates={"type": "array"},
        max_price=N),
    _fn("read_file", path=S, start_line=INT, end_line=INT),
    _fn("write_file", path=S, content=S, overwrite=B),
    _fn("run_tests", paths={"type": "array"}, options={"type": "object"}, max_failures=N,
        seed={"type": ["integer", "null"]}),
    _fn("list_files"),
]

_EMAIL_BODY = 'Hi Zoë,\n\nThe "Q3" report is attached — see §2.\n\tThanks é 😀 / \\o/'

SAMPLES = [
    # Qwen2.5-7B-Instruct: one call, nothing else.
    ("hermes", '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": '
               '"San Francisco, CA", "unit": "celsius"}}\n</tool_call>',
     "", [("get_current_weather", {"location": "San Francisco, CA", "unit": "celsius"})]),
    # Qwen2.5: a sentence, then two parallel calls.
    ("hermes", "I'll check the current temperature and the forecast for tomorrow.\n"
               '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
               '"San Francisco, CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": '
               '"get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
               '"date": "2024-10-01"}}\n</tool_call>',
     "I'll check the current temperature and the forecast for tomorrow.",
     [("get_current_temperature", {"location": "San Francisco, CA, USA"}),
      ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]),
    # Hermes-2-Pro-Llama-3-8B: "arguments" before "name".
    ("hermes", '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": '
               '"get_stock_fundamentals"}\n</tool_call>',
     "", [("get_stock_fundamentals", {"symbol": "TSLA"})]),
    # Qwen3 after its reasoning: blank lines first; a function without parameters.
    ("hermes", '\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "", [("get_time", {})]),
    # Escapes, a surrogate pair, nested values, numbers in several spellings.
    ("hermes", '<tool_call>\n{"name": "send_email", "arguments": {"to": ["zoe@example.com"], '
               '"subject": "Q3 \\u00e9", "body": "Hi Zo\\u00eb,\\n\\nThe \\"Q3\\" report is '
               'attached \\u2014 see \\u00a72.\\n\\tThanks é \\ud83d\\ude00 \\/ \\\\o/", '
               '"meta": {"priority": 1.50, "retries": 2e1, "draft": false, "cc": null, '
               '"ids": [-3, 0, 12345678901234567890]}}}\n</tool_call>',
     "", [("send_email", {"to": ["zoe@example.com"], "subject": "Q3 é", "body": _EMAIL_BODY,
                          "meta": {"priority": 1.5, "retries": 20.0, "draft": False,
                                   "cc": None, "ids": [-3, 0, 12345678901234567890]}})]),
    # No call: angle brackets, a tag-like word, a partial tag at the very end.
    ("hermes", "Use a < b, <b>bold</b> and <tools>; a <tool_calls list. Almost: <tool_ca",
     "Use a < b, <b>bold</b> and <tools>; a <tool_calls list. Almost: <tool_ca", []),
    # Llama 3.1 8B, custom tool in JSON: the whole output is the call.
    ("llama3_json", '{"name": "get_current_conditions", "parameters": {"location": '
                    '"San Francisco, CA", "unit": "Fahrenheit"}}',
     "", [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    # Llama 3.1 with <|python_tag|> (kept when special tokens are not skipped).
    ("llama3_json", '<|python_tag|>{"name": "get_current_conditions", "parameters": '
                    '{"location": "Paris, France", "unit": "Celsius"}}',
     "", [("get_current_conditions", {"location": "Paris, France", "unit": "Celsius"})]),
    # Llama 3.2 3B: "type" first, two calls joined by "; ".
    ("llama3_json", '{"type": "function", "name": "get_current_weather", "parameters": '
                    '{"location": "Paris"}}; {"type": "function", "name": '
                    '"get_current_weather", "parameters": {"location": "Tokyo"}}',
     "", [("get_current_weather", {"location": "Paris"}),
          ("get_current_weather", {"location": "Tokyo"})]),
    # Words first, then the tag; numbers, a list, a float.
    ("llama3_json", 'Let me search for flights.<|python_tag|>{"name": "search_flights", '
                    '"parameters": {"origin": "SFO", "destination": "JFK", "passengers": 2, '
                    '"dates": ["2024-12-20", "2024-12-27"], "max_price": 450.0}}',
     "Let me search for flights.",
     [("search_flights", {"origin": "SFO", "destination": "JFK", "passengers": 2,
                          "dates": ["2024-12-20", "2024-12-27"], "max_price": 450.0})]),
    ("llama3_json", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("llama3_json", '{"answer": 42, "name": "not a call"}',
     '{"answer": 42, "name": "not a call"}', []),
    # Mistral-7B-Instruct-v0.3: the JSON list after [TOOL_CALLS].
    ("mistral", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": '
                '"Paris, France", "format": "celsius"}}]',
     "", [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
    # Mistral-Nemo: two calls in the list.
    ("mistral", '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"location": '
                '"Paris, France", "format": "celsius"}}, {"name": "get_current_weather", '
                '"arguments": {"location": "London, UK", "format": "celsius"}}]',
     "", [("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
          ("get_current_weather", {"location": "London, UK", "format": "celsius"})]),
    # Mistral-Small-3.2 (tokenizer v11): name[ARGS]{...} per call, words before.
    ("mistral", "I'll check both cities.[TOOL_CALLS]get_current_weather[ARGS]{\"location\": "
                '"Paris, France", "format": "celsius"}[TOOL_CALLS]get_current_weather[ARGS]'
                '{"location": "London, UK", "format": "celsius"}',
     "I'll check both cities.",
     [("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
      ("get_current_weather", {"location": "London, UK", "format": "celsius"})]),
    ("mistral", '[TOOL_CALLS]get_current_weather[CALL_ID]a1B2c3D4e[ARGS]{"location": "Nice"}',
     "", [("get_current_weather", {"location": "Nice"})]),
    ("mistral", "Tags look like [TOOL] or [TOOL_CALL]; not [TOOL_CALLS",
     "Tags look like [TOOL] or [TOOL_CALL]; not [TOOL_CALLS", []),
    # Qwen3-Coder-30B-A3B-Instruct: typed parameters from the schema.
    ("qwen3_coder", "I'll read the file first.\n<tool_call>\n<function=read_file>\n"
                    "<parameter=path>\nsrc/main.py\n</parameter>\n<parameter=start_line>\n10\n"
                    "</parameter>\n<parameter=end_line>\n42\n</parameter>\n</function>\n"
                    "</tool_call>",
     "I'll read the file first.",
     [("read_file", {"path": "src/main.py", "start_line": 10, "end_line": 42})]),
    # Code in a string value (quotes, braces, a `<`, a "</p" that is no end tag), a boolean;
    # then a second call with an array, an object, a number and a nullable integer.
    ("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=path>\nhello.py\n"
                    "</parameter>\n<parameter=content>\ndef greet(name):\n"
                    "    if len(name) < 3:\n        return \"</p>\"\n"
                    "    print(f\"Hello, {name}!\")\n\ngreet(\"Zoë\")\n</parameter>\n"
                    "<parameter=overwrite>\ntrue\n</parameter>\n</function>\n</tool_call>\n"
                    "<tool_call>\n<function=run_tests>\n<parameter=paths>\n"
                    '["tests/test_a.py", "tests/test_b.py"]\n</parameter>\n'
                    '<parameter=options>\n{"verbose": true, "timeout": 30}\n</parameter>\n'
                    "<parameter=max_failures>\n2.5\n</parameter>\n<parameter=seed>\nnull\n"
                    "</parameter>\n</function>\n</tool_call>",
     "",
     [("write_file", {"path": "hello.py", "content":
                      'def greet(name):\n    if len(name) < 3:\n        return "</p>"\n'
                      '    print(f"Hello, {name}!")\n\ngreet("Zoë")', "overwrite": True}),
      ("run_tests", {"paths": ["tests/test_a.py", "tests/test_b.py"],
                     "options": {"verbose": True, "timeout": 30}, "max_failures": 2.5,
                     "seed": None})]),
    # A value that is not its schema's type stays text; a parameter the schema lacks is
    # text; a missing </parameter> ends at the next tag; no parameters at all.
    ("qwen3_coder", "<tool_call>\n<function=read_file>\n<parameter=start_line>\nten\n"
                    "</parameter>\n<parameter=encoding>\nutf-8\n<parameter=path>\n"
                    "\n  indented.txt\n\n</parameter>\n</function>\n</tool_call>\n"
                    "<tool_call>\n<function=list_files>\n</function>\n</tool_call>",
     "", [("read_file", {"start_line": "ten", "encoding": "utf-8",
                         "path": "\n  indented.txt\n"}),
          ("list_files", {})]),
]

# Not well-formed calls: each must come back as content, exactly.
MALFORMED = [
    ("hermes", '<tool_call>\nget_current_weather(location="Paris")\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "book_flight", "arguments": {"to": "NYC"}}\n'
               "</tool_call>"),  # not one of the request's tools
    ("hermes", '<tool_call>\n{"nam": "get_time", "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": "soon"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_time"'),  # cut off before it could be sent
    ("llama3_json", '{"name": "get_current_weather", "confidence": 0.9, "parameters": '
                    '{"location": "Paris"}}'),
    ("llama3_json", "<|python_tag|>brave_search.call(query=\"weather in Paris\")"),
    ("mistral", "[TOOL_CALLS] Sorry, I cannot call tools."),
    ("mistral", '[TOOL_CALLS]unknown_tool[ARGS]{"a": 1}'),
    ("qwen3_coder", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=delete_everything>\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=read_file\n<parameter=path>\n"),
]

# Cut off mid-call by the token limit: (parser, text, the arguments' compact text so far).
TRUNCATED = [
    ("hermes", '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": '
               '"San Fra', '{"location":"San Fra'),
    ("llama3_json", '{"name": "get_current_conditions", "parameters": {"location": "Par',
     '{"location":"Par'),
    ("mistral", '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Lyon", "form',
     '{"location":"Lyon","form'),
    ("qwen3_coder", "<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/ma",
     '{"path":"src/ma'),
]
