"""The largest legal request (services/common/message_size.py), built for real with every
field at its bound (4-byte characters, 5-byte ids), fits the bound each server takes,
and the bound is not much more than it: the router's from its Limits, a worker's from
its max_model_len and the engine's ceilings. (Sent over gRPC:
tests/integration/test_message_size_grpc.py.)"""

from __future__ import annotations

import pytest

from baton.router import wire
from baton.services.common import constraint_limits
from baton.services.common.limits import (
    BOUNDS,
    MAX_TEMPLATE_KWARGS_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    TABLE,
    Limits,
)
from baton.services.common.message_size import request_bytes, worker_request_bytes
from baton.services.common.sampling_params import MAX_START_AFTER
from baton.v1 import generation_pb2 as gen
from baton.worker.v1 import worker_pb2 as wk

WIDE = "\U0001f600"  # four bytes of UTF-8
BIG_ID = 1 << 28  # the least id that takes five bytes
SMALL = Limits(**{row.name: 64 for row in TABLE if row.flag})


def _ceiling(name: str) -> int:
    ceiling = BOUNDS[name].ceiling
    assert ceiling is not None
    return ceiling


def _sampling(stop: int, stop_chars: int, stop_ids: int) -> gen.SamplingParams:
    """Every field set; every list at its bound (the constraint: the choices, its largest
    form, holding MAX_CONSTRAINT_CHARS characters in all)."""
    each = constraint_limits.MAX_CONSTRAINT_CHARS // constraint_limits.MAX_CHOICES
    return gen.SamplingParams(
        max_tokens=2**31 - 1, temperature=0.5, top_k=-1, top_p=0.5, min_p=0.5, seed=-1,
        repetition_penalty=1.5, presence_penalty=-1.5, frequency_penalty=-1.5,
        stop=[WIDE * stop_chars] * stop, stop_token_ids=[BIG_ID] * stop_ids,
        ignore_eos=True, logprobs=-1, skip_special_tokens=True,
        include_stop_str_in_output=True, min_tokens=2**31 - 1,
        logit_bias={BIG_ID + i: -100.0 for i in range(_ceiling("logit_bias"))},
        bad_words=[WIDE * _ceiling("bad_word_chars")] * _ceiling("bad_words"),
        structured_output=gen.StructuredOutput(
            choice=gen.Choices(choices=[WIDE * each] * constraint_limits.MAX_CHOICES),
            start_after_token_ids=[BIG_ID] * MAX_START_AFTER))


def _chat(messages: int, chars: int) -> gen.ChatMessages:
    """`messages` messages (one tool call each, while there are calls to give), the
    tools, the template's variables: every string at least one character, `chars` in
    all; the rest in the first message's content."""
    chat = gen.ChatMessages(
        tools=[gen.Tool(name=WIDE, description=WIDE, parameters=WIDE)] * MAX_TOOLS,
        chat_template_kwargs='{"k":"' + WIDE * (MAX_TEMPLATE_KWARGS_CHARS - 8) + '"}')
    for i in range(messages):
        calls = [gen.ToolCall(id=WIDE, name=WIDE, arguments=WIDE)] if i < MAX_TOOL_CALLS else []
        chat.messages.append(gen.ChatMessage(
            role="assistant", content=WIDE, tool_calls=calls, tool_call_id=WIDE, name=WIDE,
            reasoning_content=WIDE))
    used = 3 * MAX_TOOLS + 4 * messages + 3 * min(messages, MAX_TOOL_CALLS)
    chat.messages[0].content = WIDE * (chars - used + 1)
    return chat


def largest_generate(limits: Limits) -> gen.GenerateRequest:
    """The largest Generate within `limits` (default Limits: enough characters for every
    string): a chat, every other field at its bound too."""
    return gen.GenerateRequest(
        request_id=WIDE * limits.max_request_id_chars,
        chat=_chat(limits.max_messages, limits.max_prompt_chars),
        sampling=_sampling(limits.max_stop, limits.max_stop_chars, limits.max_stop_token_ids),
        priority=-(2**31), cache_salt=WIDE * limits.max_cache_salt_chars,
        tool_choice=gen.ToolChoice(function="f" * 64), parallel_tool_calls=True,
        lora="a" * 128)


def largest_decode(max_model_len: int, block_size: int) -> wk.DecodeRequest:
    """The largest Decode a worker of `max_model_len` takes: the engine's ceilings."""
    rid = WIDE * _ceiling("max_request_id_chars")
    return wk.DecodeRequest(
        request_id=rid, prompt_token_ids=[BIG_ID] * max_model_len, first_token_id=BIG_ID,
        sampling=_sampling(_ceiling("max_stop"), _ceiling("max_stop_chars"),
                           _ceiling("max_stop_token_ids")),
        priority=-(2**31), cache_salt=WIDE * _ceiling("max_cache_salt_chars"),
        handle=wk.KvHandle(engine_id="e" * 64, request_id=rid, lease_id=2**64 - 1,
                           block_ids=[BIG_ID] * -(-max_model_len // block_size),
                           num_tokens=max_model_len, fingerprint="f" * 16, lease_s=1e9),
        prefill_address="h" * 253 + ":65535", output_token_ids=[BIG_ID] * max_model_len,
        lora=wk.LoraAdapter(name="a" * 128, path="/" + "p" * 4095, version=2**64 - 1))


def test_the_largest_generate_fits_the_routers_bound_and_nearly_fills_it():
    raw = largest_generate(Limits()).SerializeToString()
    wire.check_generate(Limits())(raw)  # within every bound the wire walk counts
    bound = request_bytes(Limits())
    assert 0.97 * bound < len(raw) <= bound, (len(raw), bound)
    assert bound == 17_611_996  # docs/configuration.md's Limits table
    assert worker_request_bytes(8192, 16) == 924_916  # and a worker's there


@pytest.mark.parametrize("limits", [SMALL, Limits(max_prompt_chars=64 << 20,
                                                  max_prompt_token_ids=32 << 20)],
                         ids=["small", "large"])
def test_the_routers_bound_follows_its_limits(limits):
    """Smaller limits, a smaller bound (each string still framed); larger, larger (up to
    what gRPC takes)."""
    raw = largest_generate(Limits()).SerializeToString()
    if limits is SMALL:
        assert request_bytes(SMALL) < len(raw) // 10
    else:
        assert request_bytes(limits) == 4 * (64 << 20) + request_bytes(Limits()) - 4 * (
            4 << 20)
    text = gen.GenerateRequest(text=WIDE * limits.max_prompt_chars,
                               request_id=WIDE * limits.max_request_id_chars)
    assert len(text.SerializeToString()) <= request_bytes(limits)


@pytest.mark.parametrize("max_model_len, block_size", [(8192, 16), (131072, 16), (64, 1)])
def test_the_largest_decode_fits_a_workers_bound_and_nearly_fills_it(max_model_len,
                                                                     block_size):
    raw = largest_decode(max_model_len, block_size).SerializeToString()
    bound = worker_request_bytes(max_model_len, block_size)
    assert 0.97 * bound < len(raw) <= bound, (len(raw), bound)
    # Prefill's request is a Decode's but for the handle, outputs and address.
    prefill = wk.PrefillRequest(request_id=WIDE * _ceiling("max_request_id_chars"),
                                prompt_token_ids=[BIG_ID] * max_model_len,
                                sampling=largest_decode(64, 16).sampling)
    assert len(prefill.SerializeToString()) < bound
