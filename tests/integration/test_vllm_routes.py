"""vLLM's HTTP surface on the router (router/openai/extra_routes.py), on fake workers
(router_fakes.py) and the default model's real tokenizer: /tokenize gives the ids
transformers gives (a prompt with its special tokens, messages through the chat
template; with Qwen3's tokenizer and template, tools, tool results and
chat_template_kwargs rendered as a chat completion renders them), /detokenize reads them
back, /version answers, all three behind the API key;
X-Request-Id names a completion's requests and its response and comes back on every
route, and a bad one is a 400 naming the header."""

from __future__ import annotations

import asyncio
import importlib.metadata
import re
import time

import httpx
import pytest

from baton.router.openai import app as app_module
from baton.router.openai.protocol import ChatRequest
from baton.services.common.tokenizer import load_tokenizer
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle
from tests.chat_models import qwen3_tokenizer, qwen3_tokenizer_dir
from tests.router_fakes import MAX_LEN, VOCAB, cluster

KEY = "the-key-of-a-caller"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]}]
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def hf(tok):
    return load_tokenizer(tok)


def http(tok, check, keys: tuple[str, ...] = (), **router_kw):
    """Run `check(client, cluster)` against the HTTP app over fake workers."""
    async def main():
        async with cluster(tok, api_keys=keys, **router_kw) as c:
            app = app_module.make_app(c.router, Security(ServiceConfig(), keys), Lifecycle())
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         headers=AUTH if keys else {}) as client:
                deadline = time.monotonic() + 60  # until the registry has polled a worker
                while (await client.get("/health")).status_code != 200:
                    assert time.monotonic() < deadline, "the router never became ready"
                    await asyncio.sleep(0.02)
                await check(client, c)

    asyncio.run(main())


def error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_tokenize_gives_transformers_ids_and_detokenize_reads_them_back(tok, hf):
    text = "Baton serves models: prefill here, decode there."
    want_prompt = hf.encode(text, add_special_tokens=True)
    want_chat = list(hf.apply_chat_template(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "What is 2 + 2?"}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])

    async def check(client, c):
        r = await client.post("/tokenize", json={"model": "fake", "prompt": text})
        assert r.status_code == 200, r.text
        assert r.json() == {"tokens": want_prompt, "count": len(want_prompt),
                            "max_model_len": MAX_LEN, "token_strs": None}
        back = await client.post("/detokenize", json={"model": "fake", "tokens": want_prompt})
        assert back.status_code == 200 and back.json() == {"prompt": text}
        chat = await client.post("/tokenize", json={"messages": MESSAGES,
                                                    "return_token_strs": True})
        assert chat.status_code == 200, chat.text
        body = chat.json()
        assert body["tokens"] == want_chat and body["count"] == len(want_chat)
        assert body["token_strs"] == [hf.decode([t]) for t in want_chat]
        # Special tokens are kept: the conversation reads as the template wrote it.
        back = await client.post("/detokenize", json={"tokens": want_chat})
        assert back.json()["prompt"] == hf.decode(want_chat)
        assert "<|im_start|>user" in back.json()["prompt"]

    http(tok, check)


def test_tokenize_renders_tools_and_template_kwargs_as_a_chat_does(tok):
    """Messages with an assistant's call and the tool's answer, and the tools, with and
    without enable_thinking false: /tokenize's ids are the ones a chat completion with
    the same fields renders, and transformers' apply_chat_template(messages, tools=...,
    enable_thinking=...) with Qwen3's tokenizer and template (--tokenizer)."""
    hf = qwen3_tokenizer()
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    plain = [MESSAGES[0], {"role": "user", "content": "What is 2 + 2?"},  # as transformers
             {"role": "assistant", "content": "", "tool_calls": [call]}, messages[3]]

    async def check(client, c):
        seen = []
        for kw in ({}, {"enable_thinking": False}):
            body = {"messages": messages, "tools": TOOLS, "chat_template_kwargs": kw or None}
            r = await client.post("/tokenize", json=body)
            assert r.status_code == 200, r.text
            ids = r.json()["tokens"]
            assert ids == list(hf.apply_chat_template(
                plain, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                return_dict=False, **kw))
            (chat,) = ChatRequest(model="fake", tool_choice="none", **body).requests(MAX_LEN)
            assert await c.router.intake.prompt_ids(chat, c.router.model_info()) == ids
            seen.append(ids)
        untooled = await client.post("/tokenize", json={"messages": messages})
        assert len({tuple(s) for s in (*seen, untooled.json()["tokens"])}) == 3
        text = hf.decode(seen[0])
        assert '"name": "add"' in text and "<tool_response>\n4\n</tool_response>" in text

    http(tok, check, tokenizer=str(qwen3_tokenizer_dir()))


BAD_BODIES = [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"model": "fake"}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": False}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400,
     "add_special_tokens"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}, 400,
     "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "chat_template": "{{ x }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi", "mood": "x"}]}, 400,
     "messages[0].mood"),
    ("/tokenize", {"prompt": "a", "tools": TOOLS}, 400, "tools"),
    ("/tokenize", {"prompt": "a", "chat_template_kwargs": {"x": 1}}, 400,
     "chat_template_kwargs"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function",
                                                   "function": {"name": "a b"}}]}, 400,
     "tools[0].name"),
    ("/tokenize", {"messages": MESSAGES, "tools": TOOLS * 2}, 400, "tools[1].name"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}}, 400,
     "chat_template_kwargs"),
    ("/tokenize", {"prompt": "a", "model": "another"}, 404, "model"),
    ("/detokenize", {"tokens": [1, VOCAB]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"model": "another", "tokens": [1]}, 404, "model"),
]


def test_a_bad_tokenize_or_detokenize_body_is_refused_naming_the_field(tok):
    async def check(client, c):
        for path, body, status, param in BAD_BODIES:
            got = error(await client.post(path, json=body), status)["param"]
            assert got == param, (path, body)

    http(tok, check)


def test_the_routes_are_behind_the_api_key_and_version_answers(tok):
    async def check(client, c):
        for method, path, kw in (("POST", "/tokenize", {"json": {"prompt": "a"}}),
                                 ("POST", "/detokenize", {"json": {"tokens": [1]}}),
                                 ("GET", "/version", {})):
            refused = await client.request(method, path, headers={"Authorization": ""}, **kw)
            assert error(refused, 401)["type"] == "authentication_error"
            assert (await client.request(method, path, **kw)).status_code == 200
        assert (await client.get("/version")).json() == {
            "version": importlib.metadata.version("baton-llm")}
        for path in ("/health", "/metrics"):  # open, as before
            assert (await client.get(path, headers={"Authorization": ""})).status_code == 200

    http(tok, check, keys=(KEY,))


def test_x_request_id_names_the_requests_and_the_response_and_comes_back(tok):
    async def check(client, c):
        rid = "trace-42.A_b:c"
        r = await client.post("/v1/completions", headers={"X-Request-Id": rid}, json={
            "model": "fake", "prompt": [5, 6, 7], "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == rid and r.json()["id"] == f"cmpl-{rid}"
        assert c.prefill[0].prefills[-1].startswith(f"{rid}-")
        assert c.decode[0].decodes[-1].request_id.startswith(f"{rid}-")
        stream = await client.post("/v1/chat/completions", headers={"X-Request-Id": rid},
                                   json={"model": "fake", "messages": MESSAGES,
                                         "max_tokens": 3, "stream": True})
        ids = set(re.findall(r'"id": "([^"]+)"', stream.text))
        assert stream.headers["x-request-id"] == rid and ids == {f"chatcmpl-{rid}"}
        # Without one, each response gets its own, and the ids stay the router's.
        plain = await client.post("/v1/completions", json={
            "model": "fake", "prompt": [5, 6, 7], "max_tokens": 3})
        made = plain.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", made) and made not in plain.json()["id"]
        # Every route, its errors included.
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"),
                             ("GET", "/version"), ("GET", "/nowhere"),
                             ("POST", "/v1/completions")):
            r = await client.request(method, path, headers={"X-Request-Id": "x-1"})
            assert r.headers["x-request-id"] == "x-1", (path, r.status_code)

    http(tok, check)


def test_a_bad_x_request_id_is_a_400_naming_the_header(tok):
    async def check(client, c):
        for rid, says in (("has space", "visible ASCII"), ("tab\there", "visible ASCII"),
                          ("x" * 193, "193 characters, over the limit of 192"),
                          ("", "empty")):
            r = await client.post("/v1/completions", headers={"X-Request-Id": rid}, json={
                "model": "fake", "prompt": [5, 6], "max_tokens": 2})
            err = error(r, 400)
            assert err["param"] == "X-Request-Id" and says in err["message"], err
        assert not c.prefill[0].prefills and not c.decode[0].decodes  # nothing ran

    http(tok, check)
