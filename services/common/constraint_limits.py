"""The bounds on a structured-output constraint, checked before anything parses or
compiles it: its size, how deep it nests, how many choices it lists. Depth is counted
without recursion: Python's JSON parser and encoder recurse and give up near 1,000
levels, and a compile's cost grows steeply with depth (xgrammar takes seconds on a JSON
schema 100 levels deep, minutes at 500)."""

from __future__ import annotations

import re
from collections.abc import Sequence

MAX_CONSTRAINT_CHARS = 65_536  # a JSON schema's text, a regex, a grammar, all choices
MAX_CONSTRAINT_DEPTH = 64  # JSON levels of a schema; nested groups of a regex or grammar
MAX_CHOICES = 1024

# Tokens that matter to depth; everything between them is skipped in C.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)
_REGEX_TOKENS = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|[()]", re.S)
_GRAMMAR_TOKENS = re.compile(r'\\.|"(?:[^"\\]|\\.)*"|\[(?:\\.|[^\]\\])*\]|[()]', re.S)


def check(kind: str, spec: str, choices: Sequence[str]) -> None:
    """ValueError naming the bound a constraint goes past; nothing if it keeps them all."""
    if kind == "choice":
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"structured output choice: {len(choices)} choices, over the "
                             f"limit of {MAX_CHOICES}")
        size = sum(len(c) for c in choices if isinstance(c, str))
    elif isinstance(spec, str):
        size = len(spec)
    else:
        return  # not text: StructuredOutput says so
    if size > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"structured output {kind}: {size} characters, over the limit of "
                         f"{MAX_CONSTRAINT_CHARS}")
    tokens = {"json": _JSON_TOKENS, "regex": _REGEX_TOKENS, "grammar": _GRAMMAR_TOKENS}
    if kind in tokens:
        _check_depth(kind, _text_depth(spec, tokens[kind]))


def check_json_value(value) -> None:
    """A schema given as a parsed JSON value (an HTTP body's): its depth, before it is
    encoded (the encoder recurses)."""
    depth, stack = 0, [(value, 1)]
    while stack and depth <= MAX_CONSTRAINT_DEPTH:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in item)
    _check_depth("json", depth)


def _check_depth(kind: str, depth: int) -> None:
    if depth > MAX_CONSTRAINT_DEPTH:
        raise ValueError(f"structured output {kind}: nested more than "
                         f"{MAX_CONSTRAINT_DEPTH} levels deep")


def _text_depth(text: str, tokens: re.Pattern) -> int:
    """The deepest nesting of brackets (JSON) or groups (a regex, a grammar), escapes,
    strings and character classes skipped."""
    depth = deepest = 0
    for m in tokens.finditer(text):
        c = m.group()
        if c in ("[", "{", "("):
            depth += 1
            deepest = max(deepest, depth)
        elif c in ("]", "}", ")"):
            depth -= 1
    return deepest
