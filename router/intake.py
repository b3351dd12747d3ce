"""What a request becomes before any worker sees it: checked, tokenized, and bounded.

Every check names the field it refuses (INVALID_ARGUMENT). Counts and lengths come
first (`Limits`: messages, characters, token ids, stop strings, ids and salts), before
anything is done per item. Text and chat content are also bounded by the model (no
tokenizer packs more than MAX_CHARS_PER_TOKEN characters into a token, so more than that
many per token of max_model_len cannot fit), and the tokenizer runs on a worker thread:
a multi-megabyte prompt never stalls the event loop that streams every other request.

The sampling values are checked by the engine's own rules: `convert.sampling_params`, the
router's one conversion of the wire's SamplingParams, with the model's defaults of unset
values as the workers take them (services/common/generation_config.py); the message
itself goes on to the workers as it came, but for what a chat's tool_choice and the
router's reasoning parser add to its constraint (chat.py), which also makes each
choice's output parser.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from baton.services.common.limits import TABLE, Limits, count
from baton.services.common.tokenizer import Tokenizer
from baton.services.rpc.convert import sampling_params
from baton.services.rpc.errors import InvalidArgument
from baton.v1 import generation_pb2 as gen

from .chat import Chat, ChatSettings, check_chat, plan
from .chat_output import ChatOutput
from .unparsed import ByteBudget, ParseTurns

MAX_CHARS_PER_TOKEN = 64
DEFAULT_MAX_MODEL_LEN = 32768  # the bound before any worker has said its own
UNPARSED_BYTES = 512 * 1024 * 1024  # RouterConfig.max_unparsed_bytes


@dataclass
class Job:
    """A validated request: the id the client knows, the id the workers see, the prompt,
    the request as the workers get it, and what parses a chat's output (None: nothing)."""

    client_id: str
    request_id: str
    prompt_ids: list[int]
    request: gen.GenerateRequest
    output: Callable[[], ChatOutput] | None = None


class Intake:
    def __init__(self, tokenizer: Tokenizer, threads: int = 2, limits: Limits | None = None,
                 parse_threads: int = 2, chat: ChatSettings | None = None,
                 parses_per_key: int = 1, unparsed_bytes: int = UNPARSED_BYTES,
                 sampling_defaults: dict | None = None):
        self.tokenizer = tokenizer
        # The model's defaults of unset sampling values (its generation_config.json), as
        # the workers apply them: a request is checked as it will run.
        self.sampling_defaults = dict(sampling_defaults or {})
        self.chat = chat or ChatSettings()  # the router's tool call and reasoning parsers
        self.limits = limits or Limits()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        # Requests are counted and parsed (gRPC bytes, HTTP bodies) on threads of their
        # own: a few giant bodies delay other parses, never another request's tokenizing.
        self.parse_pool = ThreadPoolExecutor(parse_threads, thread_name_prefix="parse")
        self.turns = ParseTurns(self.parse_pool, parses_per_key)  # unparsed.py
        self.unparsed = ByteBudget(unparsed_bytes)  # bodies and messages not yet parsed

    async def job(self, request: gen.GenerateRequest, info: gen.ModelInfo | None) -> Job:
        """Validate `request` against the model (`info`, when a worker has said it)."""
        for row in TABLE:  # every bounded field of the request, at its wire path
            if row.wire is not None:
                value = functools.reduce(getattr, row.wire.split("."), request)
                self.limits.check(row.name, count(row, value), row.wire)
        s = request.sampling
        try:  # the engine's own rules, before any worker sees the request
            sampling_params(s, self.sampling_defaults)
        except (ValueError, TypeError) as e:
            raise InvalidArgument(f"sampling: {e}") from None
        ids, chat = await self._prompt(request, info)
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
            bad = next((t for t in s.logit_bias if not 0 <= t < info.vocab_size), None)
            if bad is not None:
                raise InvalidArgument(f"sampling: logit_bias token id {bad} is outside the "
                                      f"vocabulary [0, {info.vocab_size})")
        client_id = request.request_id or uuid.uuid4().hex
        # Workers see a unique id, so two clients that pick the same id (or a retry) can
        # never touch each other's request or lease.
        rid = f"{client_id}-{uuid.uuid4().hex[:12]}" if request.request_id else client_id
        request, output = plan(request, chat, ids, self.chat,
                               lambda text: self.tokenizer.marker_ids(text))
        return Job(client_id, rid, ids, request, output)

    async def prompt_ids(self, request, info: gen.ModelInfo | None) -> list[int]:
        """The prompt of a Generate or Tokenize request as token ids: more than
        max_model_len of them is refused (as vLLM's /tokenize does), so no answer of
        Tokenize is bigger than a prompt the model takes."""
        ids = (await self._prompt(request, info))[0]
        if info is not None and len(ids) > info.max_model_len:
            raise InvalidArgument(f"prompt: {len(ids)} tokens; max_model_len is "
                                  f"{info.max_model_len}")
        return ids

    async def _prompt(self, request, info: gen.ModelInfo | None
                      ) -> tuple[list[int], Chat | None]:
        """The prompt's token ids, and its chat as the template took it (None: not a
        chat)."""
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            self.limits.check("max_prompt_token_ids", len(request.token_ids.ids), "token_ids")
            return list(request.token_ids.ids), None
        limit = MAX_CHARS_PER_TOKEN * (info.max_model_len if info else DEFAULT_MAX_MODEL_LEN)
        if kind == "text":
            self.limits.check("max_prompt_chars", len(request.text), "text")
            if len(request.text) > limit:
                raise InvalidArgument(f"text: {len(request.text)} characters cannot fit in "
                                      f"{limit // MAX_CHARS_PER_TOKEN} tokens")
            return await self.run(self.tokenizer.encode, request.text), None
        if kind == "chat":
            chat = check_chat(request.chat, limit, self.limits, MAX_CHARS_PER_TOKEN)
            ids = await self.run(self.tokenizer.apply_chat_template, chat.messages,
                                 chat.tools, chat.template_kwargs)
            return ids, chat
        raise InvalidArgument("prompt: the request has none (send text, token_ids or chat)")

    async def run(self, fn, *args):
        """fn(*args) on the tokenizer's threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def parse(self, fn, *args, key: str = ""):
        """fn(*args) on the parse threads, off the event loop, in the turn of the
        caller's API key (its security.key_id)."""
        return await self.turns.run(key, fn, *args)

    async def parse_message(self, key: str, load, raw: bytes):
        """A gRPC request's bytes through `load`, held against the unparsed budget
        until parsed (Overloaded when it is spent)."""
        held = self.unparsed.hold()
        held.take(len(raw))
        try:
            return await self.parse(load, raw, key=key)
        finally:
            held.release()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.parse_pool.shutdown(wait=False, cancel_futures=True)
