"""What a request becomes before any worker sees it: checked, tokenized, and bounded.

Every check names the field it refuses (INVALID_ARGUMENT). Counts and lengths come
first (`Limits`: messages, characters, token ids, stop strings, ids and salts), before
anything is done per item. Text and chat content are also bounded by the model (no
tokenizer packs more than MAX_CHARS_PER_TOKEN characters into a token, so more than that
many per token of max_model_len cannot fit), and the tokenizer runs on a worker thread:
a multi-megabyte prompt never stalls the event loop that streams every other request.

The sampling values are checked by the engine's own rules: `convert.sampling_params`, the
router's one conversion of the wire's SamplingParams; the message itself goes on to the
workers as it came.
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from baton.services.common.limits import Limits
from baton.services.common.tokenizer import Tokenizer
from baton.services.rpc.convert import chat_messages, sampling_params
from baton.services.rpc.errors import InvalidArgument
from baton.v1 import generation_pb2 as gen

MAX_CHARS_PER_TOKEN = 64
DEFAULT_MAX_MODEL_LEN = 32768  # the bound before any worker has said its own
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class Job:
    """A validated request: the id the client knows, the id the workers see, the prompt."""

    client_id: str
    request_id: str
    prompt_ids: list[int]
    request: gen.GenerateRequest


class Intake:
    def __init__(self, tokenizer: Tokenizer, threads: int = 2, limits: Limits | None = None,
                 parse_threads: int = 2):
        self.tokenizer = tokenizer
        self.limits = limits or Limits()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        # Requests are counted and parsed (gRPC bytes, HTTP bodies) on threads of their
        # own: a few giant bodies delay other parses, never another request's tokenizing.
        self.parse_pool = ThreadPoolExecutor(parse_threads, thread_name_prefix="parse")

    async def job(self, request: gen.GenerateRequest, info: gen.ModelInfo | None) -> Job:
        """Validate `request` against the model (`info`, when a worker has said it)."""
        check = self.limits.check
        check("max_request_id_chars", len(request.request_id), "request_id")
        check("max_cache_salt_chars", len(request.cache_salt), "cache_salt")
        s = request.sampling
        check("max_stop", len(s.stop), "sampling.stop")
        check("max_stop_chars", max(map(len, s.stop), default=0), "sampling.stop")
        check("max_stop_token_ids", len(s.stop_token_ids), "sampling.stop_token_ids")
        try:  # the engine's own rules, before any worker sees the request
            sampling_params(s)
        except (ValueError, TypeError) as e:
            raise InvalidArgument(f"sampling: {e}") from None
        ids = await self.prompt_ids(request, info)
        if not ids:
            raise InvalidArgument("prompt: empty (send text, token_ids or chat)")
        if info is not None:
            bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
            if bad is not None:
                raise InvalidArgument(f"token_ids: id {bad} is outside the vocabulary "
                                      f"[0, {info.vocab_size})")
            if len(ids) >= info.max_model_len:
                raise InvalidArgument(f"prompt: {len(ids)} tokens; max_model_len is "
                                      f"{info.max_model_len}")
        client_id = request.request_id or uuid.uuid4().hex
        # Workers see a unique id, so two clients that pick the same id (or a retry) can
        # never touch each other's request or lease.
        rid = f"{client_id}-{uuid.uuid4().hex[:12]}" if request.request_id else client_id
        return Job(client_id, rid, ids, request)

    async def prompt_ids(self, request, info: gen.ModelInfo | None) -> list[int]:
        """The prompt of a Generate or Tokenize request as token ids."""
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            self.limits.check("max_prompt_token_ids", len(request.token_ids.ids), "token_ids")
            return list(request.token_ids.ids)
        limit = MAX_CHARS_PER_TOKEN * (info.max_model_len if info else DEFAULT_MAX_MODEL_LEN)
        if kind == "text":
            self.limits.check("max_prompt_chars", len(request.text), "text")
            if len(request.text) > limit:
                raise InvalidArgument(f"text: {len(request.text)} characters cannot fit in "
                                      f"{limit // MAX_CHARS_PER_TOKEN} tokens")
            return await self.run(self.tokenizer.encode, request.text)
        if kind == "chat":
            messages = check_chat(request.chat, limit, self.limits)
            return await self.run(self.tokenizer.apply_chat_template, messages)
        raise InvalidArgument("prompt: the request has none (send text, token_ids or chat)")

    async def run(self, fn, *args):
        """fn(*args) on the tokenizer's threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def parse(self, fn, *args):
        """fn(*args) on the parse threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.parse_pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.parse_pool.shutdown(wait=False, cancel_futures=True)


def check_chat(chat: gen.ChatMessages, max_chars: int, limits: Limits
               ) -> list[dict[str, str]]:
    """The messages, or InvalidArgument naming the first bad field."""
    if not chat.messages:
        raise InvalidArgument("chat.messages: empty; send at least one message")
    limits.check("max_messages", len(chat.messages), "chat.messages")
    total = 0
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(f"chat.messages[{i}].role: {m.role!r} is not one of "
                                  f"{', '.join(CHAT_ROLES)}")
        total += len(m.content)
    limits.check("max_prompt_chars", total, "chat.messages")
    if total > max_chars:
        raise InvalidArgument(f"chat.messages: {total} characters of content cannot fit in "
                              f"{max_chars // MAX_CHARS_PER_TOKEN} tokens")
    return chat_messages(chat)
