"""What the HTTP API renders, and how much of it the router holds: the answer's bound
reckoned as vLLM's users would, whole responses written a piece at a time on a thread
(the same JSON as the stream's chunks give), a run's bounded queue for a client that
reads nothing, and a stream that keeps no reply once its chunk went out."""

from __future__ import annotations

import asyncio
import json
import tracemalloc

import pytest

from baton.router.openai import app as app_module
from baton.router.openai.protocol import ChatRequest, CompletionRequest
from baton.router.openai.render import ROWS, Choice, Renderer
from baton.router.runs import QUEUED, Run
from baton.services.common.finish import FinishReason
from baton.services.common.limits import Limits, OverLimit
from baton.v1 import generation_pb2 as gen

CHAT = [{"role": "user", "content": "hi"}]


def _reply(k: int, top: int, last: bool = False) -> gen.GenerateResponse:
    """The k-th token's reply, with the token's own logprob and `top` more."""
    entries = [gen.Logprob(token_id=k, logprob=-0.25)] + [
        gen.Logprob(token_id=k + 1 + j, logprob=-1.0 - j) for j in range(top)]
    return gen.GenerateResponse(delta=gen.TokenDelta(
        token_ids=[k], text=f"<{k}>", logprobs=[gen.TokenLogprobs(entries=entries)],
        finish_reason=gen.FINISH_REASON_LENGTH if last else 0),
        usage=gen.Usage(prompt_tokens=7, completion_tokens=k + 1) if last else None)


@pytest.mark.parametrize("body, total, named", [
    (ChatRequest(model="m", messages=CHAT, n=128, max_tokens=4096, logprobs=True,
                 top_logprobs=20), 128 * 4096 * 21,
     ("max_tokens: 1 prompt(s) x n 128 x max_tokens 4096 x (1 + top_logprobs 20)",)),
    (ChatRequest(model="m", messages=CHAT, n=2, max_completion_tokens=9000, logprobs=True,
                 top_logprobs=5), 2 * 9000 * 6, ("max_completion_tokens: ",)),
    # Unset in a chat: the whole context, as vLLM reads it.
    (ChatRequest(model="m", messages=CHAT, n=4), 4 * 32768, ("max_tokens 32768", "+ top_")),
    (CompletionRequest(model="m", prompt=["a", "b", "c"], n=2, max_tokens=1000,
                       logprobs=3), 3 * 2 * 1000 * 4, ("3 prompt(s) x n 2", "(1 + logprobs 3)")),
])
def test_the_answer_bound_is_n_x_max_tokens_x_one_plus_top_logprobs(body, total, named):
    requests = body.requests(32768)
    body.check_answer(requests, Limits(max_answer_tokens=total))  # at the bound: served
    with pytest.raises(OverLimit) as e:
        body.check_answer(requests, Limits(max_answer_tokens=total - 1))
    assert f"= {total} tokens and logprobs" in str(e.value)
    assert "(--max-answer-tokens)" in str(e.value)
    for part in named:
        assert part in str(e.value), str(e.value)


@pytest.mark.parametrize("chat", [True, False])
def test_a_whole_response_is_the_json_the_chunks_give(chat):
    """Past ROWS tokens, split into pieces: the same logprobs as one render of all."""
    renderer = Renderer(chat, "m", lambda t: f"t{t}é")
    renderer.echo = [] if chat else ["echo: ", "echo: "]
    choices, top, count = [Choice(0), Choice(1)], 3, 2 * ROWS + 7
    for k in range(count):
        choices[0].add(_reply(k, top, last=k == count - 1))
    choices[1].add(_reply(5, top, last=True))
    body = json.loads(renderer.whole_json(choices, 2, top))
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": count + 1,
                             "total_tokens": count + 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    for c, got in zip(choices, body["choices"], strict=True):
        assert got["logprobs"] == renderer.logprobs(c.logprobs, c.token_ids, top)
        assert got["finish_reason"] == FinishReason.LENGTH and got["index"] == c.index
        text = "".join(f"<{t}>" for t in c.token_ids)
        assert (got["message"] == {"role": "assistant", "content": text} if chat
                else got["text"] == "echo: " + text)
    if not chat:  # offsets run on across the pieces
        offsets = body["choices"][0]["logprobs"]["text_offset"]
        assert offsets[ROWS] == sum(len(f"t{k}é") for k in range(ROWS))




class _Router:
    """Streams `count` replies per request at once, counting what it made."""

    def __init__(self, count: int):
        self.count, self.made = count, 0

    async def generate(self, request, caller, admission):
        for k in range(self.count):
            self.made += 1
            yield _reply(k, 0, last=k == self.count - 1)


class _Admission:
    held = 0

    def release(self, count: int = 1) -> None:
        pass


def test_a_run_holds_a_bounded_queue_for_a_client_that_reads_nothing():
    async def main():
        router, count = _Router(5000), 2
        run = Run(router, [gen.GenerateRequest()] * count, count, None, _Admission())
        run.start()
        events = run.events().__aiter__()
        await events.__anext__()  # the first token (the second choice starts), then
        for _ in range(200):  # nothing read while the loop turns: no timing, only turns
            await asyncio.sleep(0)
        # Without a bound the choices would have run to their end into the queue.
        assert run._events.qsize() <= QUEUED and router.made <= QUEUED + 2 * count, (
            router.made)
        got = 1 + sum([1 async for _ in events])  # read, every reply comes, in order
        await run.close()
        return got, router.made

    assert asyncio.run(main()) == (2 * 5000, 2 * 5000)


class _Run:
    async def close(self) -> None:
        pass


async def _take(stream, n: int) -> int:
    """The length of the stream's next n events, each dropped."""
    return sum([len(await stream.__anext__()) for _ in range(n)])


def test_a_stream_keeps_no_reply_once_its_chunk_went_out():
    """Each chunk's reply (20 logprobs a token) is dropped once the chunk is out: a long
    stream costs the router what is in flight, not all that it sent."""
    count = 1000

    async def replies():
        for k in range(count):
            yield 0, _reply(k, 20, last=k == count - 1)

    async def main():
        renderer = Renderer(True, "m", str)
        stream = app_module._sse(_Run(), replies(), None, renderer, 1, 1, 20, True)
        sent = await _take(stream, 100)  # warmed up
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            sent += await _take(stream, count - 200)
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        rest = [x async for x in stream]
        assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == count
        return grown, sent

    grown, sent = asyncio.run(main())
    # Kept, the replies' logprobs and texts hold about 180 KB here (of the 1.3 MB of
    # chunks sent); dropped, nothing is left of them (0.5 KB).
    assert grown < 50_000, (grown, sent)
