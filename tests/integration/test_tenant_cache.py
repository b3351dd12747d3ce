"""One tenant cannot see another through the prefix cache: with API keys, each key's
callers hash their blocks in a namespace of their own (the router folds the key's id into
the cache salt), so another key's prompt is never a hit, neither in `cached_tokens` nor in
the router's `expected_cached_blocks`; the same key's is. `--shared-prefix-cache` shares
on purpose; without keys there is one namespace. On fake workers (router_fakes.py) whose
cache hashes blocks as the engine does (the engine keeps salts apart:
test_prefix_cache.py::test_cache_salt_isolates)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from baton.cli.flags import values
from baton.cli.main import parse
from baton.router.config import RouterConfig
from baton.router.openai import app as app_module
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.security import Security, key_id
from baton.services.rpc.server import Lifecycle
from tests.router_fakes import cluster, expected, tokens

KEYS = ("key-of-tenant-a", "key-of-tenant-b")
PROMPT = list(range(300, 369))  # four blocks an engine would reuse, and five tokens
CACHED = 4 * 16


def _seen(msgs) -> tuple[int, int]:
    """(cached_tokens, expected_cached_blocks) of a finished stream."""
    return msgs[-1].usage.cached_tokens, msgs[0].timings.expected_cached_blocks


def test_another_keys_prompt_is_never_a_hit_and_the_same_keys_is(tok):
    a, b = KEYS

    async def main():
        # The router's default worker timeout, not the fakes' 0.5 s: under load a slow
        # poll must not drop the workers' events this test reads back.
        async with cluster(tok, api_keys=KEYS, worker_timeout=3.0) as c:
            first = await c.generate(PROMPT, 4, key=a)
            assert tokens(first) == expected(PROMPT, 4) and _seen(first) == (0, 0)
            assert _seen(await c.generate(PROMPT, 4, key=b)) == (0, 0)
            # B cannot reach A's namespace by spelling it in its own salt either.
            spelled = await c.generate(PROMPT, 4, key=b, cache_salt=f"{key_id(a)}/")
            assert _seen(spelled) == (0, 0)
            # The router's view from the workers' own events, not only its predictions
            # (a loaded CI run once saw (64, 0) here: neither had reached the router).
            await c.polled()
            assert _seen(await c.generate(PROMPT, 4, key=a)) == (CACHED, 4)
            assert _seen(await c.generate(PROMPT, 4, key=b)) == (CACHED, 4)
            # A salt of its own still splits one key's requests.
            assert _seen(await c.generate(PROMPT, 4, key=a, cache_salt="x")) == (0, 0)
            salts = [r.cache_salt for r in c.decode[0].decodes]
            assert len(set(salts)) == 4  # a, b, b's spelling, a with "x"
            assert not any(k in s for k in KEYS for s in salts)  # ids, never the keys
            await c.settle()
            assert c.leases_held() == 0

    asyncio.run(main())


@pytest.mark.parametrize("keys, shared", [(KEYS, True), ((), False)])
def test_shared_on_purpose_or_without_keys_one_cache_serves_everyone(tok, keys, shared):
    a, b = KEYS if keys else (None, None)

    async def main():
        async with cluster(tok, api_keys=keys, shared_prefix_cache=shared) as c:
            assert _seen(await c.generate(PROMPT, 4, key=a)) == (0, 0)
            assert _seen(await c.generate(PROMPT, 4, key=b)) == (CACHED, 4)
            # What the workers see is the request's own salt, as before keys existed.
            await c.generate(PROMPT, 4, key=a, cache_salt="s")
            assert [r.cache_salt for r in c.decode[0].decodes] == ["", "", "s"]

    asyncio.run(main())


def test_over_http_each_key_has_its_own_cache_too(tok):
    a, b = KEYS

    async def main():
        async with cluster(tok, api_keys=KEYS) as c:
            app = app_module.make_app(c.router, Security(ServiceConfig(), KEYS), Lifecycle())
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                async def cached(key: str) -> int:
                    r = await http.post("/v1/completions", headers={
                        "Authorization": f"Bearer {key}"}, json={
                        "model": "fake", "prompt": PROMPT, "max_tokens": 4})
                    assert r.status_code == 200, r.text
                    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

                assert [await cached(k) for k in (a, b, a)] == [0, 0, CACHED]

    asyncio.run(main())


def test_a_keys_id_names_it_alone_and_gives_nothing_away():
    one, same = Security(ServiceConfig(), KEYS), Security(ServiceConfig(), KEYS[::-1])
    ids = [one.key_id(f"Bearer {k}") for k in KEYS]
    assert ids == [same.key_id(f"bearer {k}") for k in KEYS] == [key_id(k) for k in KEYS]
    assert len(set(ids)) == 2 and all(k not in i for k in KEYS for i in ids)
    assert one.grpc_key_id((("authorization", f"Bearer {KEYS[1]}"),)) == ids[1]
    for refused in (None, "", KEYS[0], f"Basic {KEYS[0]}", "Bearer nope"):
        assert one.key_id(refused) is None and not one.key_ok(refused)
    assert Security(ServiceConfig()).key_id(None) == ""  # no keys: everyone is the same


def test_the_flag_shares_the_cache():
    for argv, want in (([], False), (["--shared-prefix-cache"], True)):
        args, flags = parse(["serve", "--role", "router", *argv])
        assert RouterConfig(**values(args, flags, "router")["router"]).shared_prefix_cache \
            is want
