"""The clients refuse a bad constraint before any call (they open a channel; the rest of the
structured-output API: tests/unit/test_structured_api.py)."""

from __future__ import annotations

import asyncio

import pytest

from baton.v1 import generation_pb2 as gen
from baton_client import AsyncClient, Client


@pytest.mark.parametrize("bad", [{"regex": "a", "grammar": "b"}, {"xml": "a"}, {},
                                 {"choice": "yes"}, {"json_object": False}, {"regex": 3},
                                 gen.StructuredOutput(), "regex"])
def test_a_bad_client_constraint_is_a_type_error_before_any_call(bad):
    with Client("127.0.0.1:1") as c:
        with pytest.raises(TypeError, match="structured_output"):
            c.generate("hi", structured_output=bad)

    async def main():
        async with AsyncClient("127.0.0.1:1") as c:
            with pytest.raises(TypeError, match="structured_output"):
                c.generate("hi", structured_output=bad)
            with pytest.raises(TypeError, match="structured_output"):
                await c.complete("hi", structured_output=bad)
    asyncio.run(main())
