"""Between the wire messages and plain Python values. Torch-free: the router uses it too,
so it builds SamplingParams keyword arguments rather than the engine's class."""

from __future__ import annotations

from baton.v1 import generation_pb2 as gen

FINISH = {None: gen.FINISH_REASON_UNSPECIFIED, "stop": gen.FINISH_REASON_STOP,
          "length": gen.FINISH_REASON_LENGTH, "abort": gen.FINISH_REASON_ABORT}
FINISH_NAME = {v: k for k, v in FINISH.items()}

_OPTIONAL = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
             "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
             "skip_special_tokens")


def sampling_kwargs(msg: gen.SamplingParams) -> dict:
    """Keyword arguments for the engine's SamplingParams: only the fields that are set."""
    kw = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    if msg.stop:
        kw["stop"] = tuple(msg.stop)
    if msg.stop_token_ids:
        kw["stop_token_ids"] = tuple(msg.stop_token_ids)
    if msg.ignore_eos:
        kw["ignore_eos"] = True
    if msg.include_stop_str_in_output:
        kw["include_stop_str_in_output"] = True
    return kw


def sampling_message(**kw) -> gen.SamplingParams:
    """The inverse, for clients: SamplingParams fields as keyword arguments."""
    msg = gen.SamplingParams()
    for name, value in kw.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids"):
            getattr(msg, name).extend([value] if isinstance(value, str) else value)
        else:
            setattr(msg, name, value)
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


def chat_messages(msg: gen.ChatMessages) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in msg.messages]
