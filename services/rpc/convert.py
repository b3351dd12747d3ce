"""Between the wire messages and plain Python values; torch-free, for the router and the
workers alike. The sampling seams, one conversion per boundary a request crosses:

    HTTP body (or a client) -> the wire   `sampling_message`: values to the message
                                          (router/openai/protocol.py, cli/generate.py)
    the wire -> the router                `sampling_params` with the model's defaults
                                          (as a worker's): the router's check
                                          (router/intake.py), its result dropped
    the wire -> a worker                  `sampling_params` with the model's defaults,
                                          once per Prefill or Decode call: the engine
                                          takes that SamplingParams as it is

The model's defaults are its generation_config.json's (services/common/
generation_config.py), read by the router and the workers alike; SamplingParams' own
defaults are spelled on its fields alone (`DEFAULTS`).

The router forwards the message it checked to the prefill and decode workers as it came:
no dict, no second message.
"""

from __future__ import annotations

from typing import cast

from baton.v1 import generation_pb2 as gen

from ..common.finish import FinishReason
from ..common.sampling_params import SamplingParams, StructuredOutput

# The one mapping between FinishReason and the wire's enum (FINISH_REASON_<NAME>); None is
# UNSPECIFIED: the request goes on.
FINISH: dict[FinishReason | None, gen.FinishReason] = {None: gen.FINISH_REASON_UNSPECIFIED} | {
    r: cast(gen.FinishReason, gen.FinishReason.Value(f"FINISH_REASON_{r.name}"))
    for r in FinishReason}
FINISH_NAME: dict[int, FinishReason | None] = {v: k for k, v in FINISH.items()}


def finish_reason_of(number: int) -> FinishReason | None:
    """The wire's finish reason; a number this side does not know (a newer peer's) ends
    the request as an abort."""
    return FINISH_NAME.get(number, FinishReason.ABORT)


_OPTIONAL = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
             "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
             "skip_special_tokens", "min_tokens")


def sampling_params(msg: gen.SamplingParams, defaults: dict | None = None) -> SamplingParams:
    """The request's values; where it leaves one unset, `defaults` (the model's
    generation_config.json, on a worker), else SamplingParams' own. ValueError or
    TypeError, naming the field, if SamplingParams refuses them."""
    kw = dict(defaults or {})
    kw.update((name, getattr(msg, name)) for name in _OPTIONAL if msg.HasField(name))
    # The message's lists go as they are: SamplingParams counts each before it copies it.
    if msg.stop:
        kw["stop"] = msg.stop
    if msg.stop_token_ids:
        kw["stop_token_ids"] = msg.stop_token_ids
    if msg.ignore_eos:
        kw["ignore_eos"] = True
    if msg.include_stop_str_in_output:
        kw["include_stop_str_in_output"] = True
    if msg.HasField("structured_output"):
        kw["structured"] = structured_of(msg.structured_output)
    if msg.logit_bias:
        kw["logit_bias"] = msg.logit_bias
    if msg.bad_words:
        kw["bad_words"] = msg.bad_words
    return SamplingParams(**kw)


def sampling_message(**kw) -> gen.SamplingParams:
    """The wire's SamplingParams from its fields as keyword arguments (`structured=` a
    StructuredOutput; `logit_bias` a dict of token id to bias; None: unset), for clients
    and the OpenAI routes."""
    msg = gen.SamplingParams()
    for name, value in kw.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids", "bad_words"):
            getattr(msg, name).extend([value] if isinstance(value, str) else value)
        elif name == "logit_bias":
            msg.logit_bias.update(value)
        elif name == "structured":
            msg.structured_output.CopyFrom(structured_message(value))
        else:
            setattr(msg, name, value)
    return msg


def structured_of(msg: gen.StructuredOutput) -> StructuredOutput:
    """The wire's constraint as the engine's; ValueError if none is set or it is malformed
    (the checks are StructuredOutput's own, each list counted before it is copied)."""
    which = msg.WhichOneof("constraint")
    after = msg.start_after_token_ids
    if which == "json_schema":
        return StructuredOutput("json", msg.json_schema, start_after=after)
    if which == "json_object":
        if not msg.json_object:
            raise ValueError("structured output json_object: must be true when set")
        return StructuredOutput("json_object", start_after=after)
    if which == "choice":
        return StructuredOutput("choice", choices=msg.choice.choices, start_after=after)
    if which in ("regex", "grammar"):
        return StructuredOutput(which, getattr(msg, which), start_after=after)
    raise ValueError("structured output: no constraint set (json_schema, json_object, "
                     "regex, grammar or choice)")


def structured_message(so: StructuredOutput) -> gen.StructuredOutput:
    msg = gen.StructuredOutput(start_after_token_ids=so.start_after)
    if so.kind == "json":
        msg.json_schema = so.spec
    elif so.kind == "json_object":
        msg.json_object = True
    elif so.kind == "choice":
        msg.choice.choices.extend(so.choices)
    else:
        setattr(msg, so.kind, so.spec)  # regex or grammar: the field of that name
    return msg


def logprobs_messages(logprobs: list[dict[int, float]]) -> list[gen.TokenLogprobs]:
    return [gen.TokenLogprobs(entries=[gen.Logprob(token_id=t, logprob=lp)
                                       for t, lp in d.items()]) for d in logprobs]


def set_stop_reason(msg, stop_reason: str | int | None) -> None:
    if isinstance(stop_reason, str):
        msg.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        msg.stop_token_id = stop_reason


def stop_reason_of(msg) -> str | int | None:
    which = msg.WhichOneof("stop_reason")
    return None if which is None else getattr(msg, which)
