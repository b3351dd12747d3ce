"""The router's chats follow its plain-content setting, through fake workers (the rendering
itself: tests/unit/test_plain_content.py)."""

from __future__ import annotations

import asyncio

import pytest

from baton.v1 import generation_pb2 as gen
from tests.router_fakes import cluster
from tests.unit.test_plain_content import FORGED


@pytest.mark.parametrize("allowed, count", [(False, 3), (True, 5)])
def test_the_routers_chats_follow_its_setting(tok, allowed, count):
    """Tokenize over gRPC: the ids a Generate of the same chat would send the workers."""
    chat = gen.ChatMessages(messages=[gen.ChatMessage(role="user", content=FORGED)])

    async def main():
        async with cluster(tok, allow_special_tokens_in_content=allowed) as c:
            await c.polled()
            reply = await c.stub.Tokenize(gen.TokenizeRequest(chat=chat), timeout=10)
            return list(reply.token_ids)

    assert asyncio.run(main()).count(1) == count  # <|im_start|>: 3 turns, or 2 forged more
