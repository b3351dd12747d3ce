"""How many bytes the largest legal request holds on the wire, from the bounds on its
fields: each gRPC server takes at most that (`grpc.max_receive_message_length`), so a
bigger message is refused by gRPC itself (RESOURCE_EXHAUSTED) before a byte of it
reaches Python. Torch- and gRPC-free.

    the router    `request_bytes(limits)`: a Generate with every field at the router's
                  bounds (Tokenize and the adapter calls hold less)
    a worker      `worker_request_bytes(max_model_len, block_size)`: a Decode with every
                  field at the engine's ceilings (Prefill and the others hold less)

Each is a sum of worst cases, as protobuf's encoders write a message (each field once): a
character is at most 4 bytes of UTF-8, an id (a token's, a block's: never negative) at
most a 5-byte varint, and every string or message adds its tag and length (FIELD).
"""

from __future__ import annotations

from . import constraint_limits
from .limits import (
    BOUNDS,
    MAX_TEMPLATE_KWARGS_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    Limits,
)
from .sampling_params import MAX_START_AFTER

CHAR = 4  # bytes of one character in UTF-8, at most
ID = 5  # bytes of a non-negative int32 as a varint, at most
FIELD = 8  # a field's tag (up to 3 bytes) and length (up to 5)
# Every field of fixed size (numbers, flags, enums: at most 11 bytes each with its tag,
# fewer than 64 in any request), and the short strings no row bounds: an adapter's name
# (128 characters, services/lora/names.py), a tool's name in tool_choice (64), an engine
# id, a prefill worker's address, a fingerprint.
FIXED = 4096
ROLE = FIELD + 9  # a chat message's role: one of router/chat.py's CHAT_ROLES
PATH = FIELD + 4096  # an adapter's path: at most PATH_MAX bytes (Linux)
MAX_GRPC_BYTES = 2**31 - 1  # what gRPC takes as a limit


def _strings(count: int, chars: int) -> int:
    """`count` strings holding `chars` characters in all."""
    return count * FIELD + CHAR * chars


def _ceiling(name: str) -> int:
    ceiling = BOUNDS[name].ceiling
    assert ceiling is not None, name
    return ceiling


def sampling_bytes(stop: int, stop_chars: int, stop_token_ids: int) -> int:
    """SamplingParams with `stop` strings of `stop_chars` characters and `stop_token_ids`
    ids, and every other list at the engine's ceilings:

          FIELD                                    (the message itself)
        + stop x (FIELD + 4 x stop_chars)
        + FIELD + 5 x stop_token_ids               (packed)
        + logit_bias x (FIELD + 1 + 5 + 1 + 4)     (an entry: its key, its float)
        + bad_words x (FIELD + 4 x bad_word_chars)
        + structured output: 2 FIELD + 4 x MAX_CONSTRAINT_CHARS (a schema, a regex, a
          grammar, or all the choices) + MAX_CHOICES x FIELD + FIELD + 5 x MAX_START_AFTER
    """
    structured = (2 * FIELD + CHAR * constraint_limits.MAX_CONSTRAINT_CHARS
                  + constraint_limits.MAX_CHOICES * FIELD + FIELD + ID * MAX_START_AFTER)
    return (FIELD + stop * (FIELD + CHAR * stop_chars) + FIELD + ID * stop_token_ids
            + _ceiling("logit_bias") * (FIELD + 1 + ID + 1 + 4)
            + _ceiling("bad_words") * (FIELD + CHAR * _ceiling("bad_word_chars"))
            + structured)


def chat_bytes(messages: int, chars: int) -> int:
    """A chat of `messages` messages whose strings hold `chars` characters in all:

          2 FIELD + 4 x (chars + MAX_TEMPLATE_KWARGS_CHARS)   (the chat, its kwargs)
        + messages x (FIELD + ROLE + 4 FIELD)         (each, its role, its four strings)
        + MAX_TOOL_CALLS x 4 FIELD + MAX_TOOLS x 4 FIELD   (each, its three strings)
    """
    return (2 * FIELD + CHAR * (chars + MAX_TEMPLATE_KWARGS_CHARS)
            + messages * (FIELD + ROLE + 4 * FIELD)
            + (MAX_TOOL_CALLS + MAX_TOOLS) * 4 * FIELD)


def request_bytes(limits: Limits) -> int:
    """The largest Generate the router takes within `limits`:

          FIELD + 4 x max_request_id_chars
        + the largest prompt: text (FIELD + 4 x max_prompt_chars), token ids
          (2 FIELD + 5 x max_prompt_token_ids) or a chat (chat_bytes: max_messages,
          max_prompt_chars)
        + sampling_bytes(max_stop, max_stop_chars, max_stop_token_ids)
        + FIELD + 4 x max_cache_salt_chars
        + FIXED
    """
    prompt = max(FIELD + CHAR * limits.max_prompt_chars,
                 2 * FIELD + ID * limits.max_prompt_token_ids,
                 chat_bytes(limits.max_messages, limits.max_prompt_chars))
    total = (FIELD + CHAR * limits.max_request_id_chars + prompt
             + sampling_bytes(limits.max_stop, limits.max_stop_chars,
                              limits.max_stop_token_ids)
             + FIELD + CHAR * limits.max_cache_salt_chars + FIXED)
    return min(total, MAX_GRPC_BYTES)


def worker_request_bytes(max_model_len: int, block_size: int) -> int:
    """The largest Decode a worker of `max_model_len` takes (what the router sends it is
    within the engine's ceilings, and its prompt within max_model_len):

          2 x (FIELD + 4 x the request_id ceiling)   (the request's, its KV handle's)
        + 2 x (FIELD + 5 x max_model_len)            (the prompt, and what was generated)
        + FIELD + 5 x ceil(max_model_len / block_size)   (the handle's blocks)
        + sampling_bytes at the engine's ceilings
        + FIELD + 4 x the cache_salt ceiling
        + PATH + FIXED                               (an adapter's path, the rest)
    """
    blocks = -(-max_model_len // block_size)
    total = (2 * (FIELD + CHAR * _ceiling("max_request_id_chars"))
             + 2 * (FIELD + ID * max_model_len) + FIELD + ID * blocks
             + sampling_bytes(_ceiling("max_stop"), _ceiling("max_stop_chars"),
                              _ceiling("max_stop_token_ids"))
             + FIELD + CHAR * _ceiling("max_cache_salt_chars") + PATH + FIXED)
    return min(total, MAX_GRPC_BYTES)
