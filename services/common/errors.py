"""Errors every layer may raise, torch- and gRPC-free; the services' one interceptor
(services/rpc/server.py) gives each its status code. And `shown`, the one way an error
message quotes a caller's value."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import islice

SHOWN_CHARS = 80  # of a value quoted in an error message, about


class NotFound(Exception):
    """A named thing this service does not hold (a LoRA adapter): NOT_FOUND, or 404."""


def shown(value, most: int = SHOWN_CHARS) -> str:
    """`value` as an error message quotes it: its repr, cut to about `most` characters,
    with its size when cut ("'aaaa...'... (30000000 characters)", "(5, 5, ...)... (60000000
    items)"). Only the items shown are looked at: quoting a giant field costs its error
    no more than a small one (a whole repr of 60M token ids took seconds and 180 MB)."""
    if isinstance(value, (str, bytes)):
        text = repr(value[:most])
        if len(value) <= most and len(text) <= 2 * most:
            return text
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{text[:most]}... ({len(value)} {unit})"
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):  # Python refuses to print one of over 4300 digits
        return repr(value) if value.bit_length() <= 256 else \
            f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, Mapping):
        return _items((f"{shown(k, most)}: {shown(v, most)}" for k, v in
                       islice(value.items(), most)), "{}", len(value), most)
    if hasattr(value, "__len__") and hasattr(value, "__iter__"):
        brackets = "()" if isinstance(value, tuple) else "[]"
        return _items((shown(v, most) for v in islice(value, most)), brackets, len(value),
                      most)
    text = repr(value)
    return text if len(text) <= most else f"{text[:most]}..."


def _items(parts, brackets: str, count: int, most: int) -> str:
    """The items' texts in their brackets, as many as fit in about `most` characters."""
    kept, size = [], 1
    for part in parts:
        if kept and size + len(part) > most:
            break
        kept.append(part)
        size += len(part) + 2
    text = brackets[0] + ", ".join(kept)
    if len(kept) == count:
        return text + ("," if brackets == "()" and count == 1 else "") + brackets[1]
    return f"{text}, ...{brackets[1]} ({count} items)"
