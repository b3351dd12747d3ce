"""vLLM's gRPC engine API (`vllm.grpc.engine.VllmEngine`, from smg-grpc-proto) in Baton's
own terms: a GenerateRequest becomes the baton.v1 requests of its choices, which then
take the router's one path (admission, the intake's checks, limits, keys, routing); each
baton.v1 reply becomes the chunks and the completion vLLM's servicer sends.

Every request field has the effect vLLM gives it, or is refused with INVALID_ARGUMENT
naming it (`REFUSED`, and the values checked in `sampling`). Unset and zero values read
as vLLM's servicer reads them: no temperature is 1.0, top_p and repetition_penalty 0 are
off, top_k 0 is off, n 0 is 1, no max_tokens runs to the end of the context. The engine's
generation_config defaults are not applied here (vLLM's engine does not apply them
either): GetModelInfo hands them to the gateway (`default_sampling_params_json`), which
applies them to what its client left unset.

Replies, as vLLM's servicer sends them: streamed, a chunk per reply with new tokens
(their count as completion_tokens), then on the last a completion carrying that last
reply's tokens again (the gateway adds up the chunks and reads the completion's finish
reason, stop and usage); not streamed, one completion with every token.
"""

from __future__ import annotations

import uuid

from smg_grpc_proto.generated import vllm_engine_pb2 as vllm

from baton.services.rpc.errors import InvalidArgument
from baton.v1 import generation_pb2 as gen

# Fields Baton does not take, with why (vLLM's P/D hand-off is its own connector's: Baton's
# router disaggregates behind this API by itself).
REFUSED = {
    "kv_transfer_params": "vLLM's P/D hand-off (Mooncake) is not supported: Baton's "
                          "router disaggregates prefill and decode itself",
    "kv_transfer_params_json": "vLLM's P/D hand-off (its KV connector's parameters) is not "
                               "supported: Baton's router disaggregates prefill and decode "
                               "itself",
    "mm_inputs": "multimodal input is not supported (Baton serves text models)",
    "extra_mm_inputs": "multimodal input is not supported (Baton serves text models)",
    "media_refs": "multimodal input is not supported (Baton serves text models)",
}
FINISH = {gen.FINISH_REASON_STOP: "stop", gen.FINISH_REASON_LENGTH: "length",
          gen.FINISH_REASON_ABORT: "abort", gen.FINISH_REASON_CONSTRAINT: "stop",
          gen.FINISH_REASON_TOOL_CALLS: "stop"}


INT32_MAX = 2**31 - 1


def int32(name: str, value: int) -> int:
    """A vLLM uint32 as baton.v1's int32, refused past it (no engine takes so many)."""
    if value > INT32_MAX:
        raise InvalidArgument(f"sampling_params.{name}: {value}; at most {INT32_MAX}")
    return value


def refuse_unsupported(request: vllm.GenerateRequest) -> None:
    present = {fd.name for fd, _ in request.ListFields()}  # set, or a non-empty list
    for name, why in REFUSED.items():
        if name in present:
            raise InvalidArgument(f"{name}: {why}")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidArgument(f"data_parallel_rank: {request.data_parallel_rank}; a Baton "
                              "engine is one data-parallel rank (0)")


def prompt(request: vllm.GenerateRequest) -> dict:
    """The prompt as baton.v1's oneof: token ids (truncated to the last
    truncate_prompt_tokens, as vLLM truncates), or text."""
    s = request.sampling_params
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        ids = list(request.tokenized.input_ids)
        bad = next((t for t in ids if t > INT32_MAX), None)
        if bad is not None:  # baton.v1's ids are int32; the vocabulary is far smaller
            raise InvalidArgument(f"tokenized.input_ids: id {bad} is outside the vocabulary")
        if s.HasField("truncate_prompt_tokens"):
            keep = s.truncate_prompt_tokens
            if keep == 0 or keep < -1:
                raise InvalidArgument(f"sampling_params.truncate_prompt_tokens: {keep}; at "
                                      "least 1, or -1 (the model's length)")
            if keep > 0:
                ids = ids[-keep:]
        return {"token_ids": gen.TokenIds(ids=ids)}
    if kind == "text":
        if s.HasField("truncate_prompt_tokens"):
            raise InvalidArgument("sampling_params.truncate_prompt_tokens: needs a tokenized "
                                  "prompt")
        return {"text": request.text}
    raise InvalidArgument("input: none; send tokenized or text")


def sampling(s: vllm.SamplingParams, max_model_len: int) -> gen.SamplingParams:
    """baton.v1's sampling for vLLM's (the values are then checked by the intake as any
    request's are: ranges, stop strings, logit_bias ids, the constraint)."""
    if s.HasField("logprobs") and s.logprobs < 0:
        raise InvalidArgument(f"sampling_params.logprobs: {s.logprobs}; all (-1) is not "
                              "supported, 0 to 20")
    if s.HasField("prompt_logprobs"):
        raise InvalidArgument("sampling_params.prompt_logprobs: not supported (the prompt's "
                              "logprobs are not computed)")
    out = gen.SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.top_p != 0.0 else 1.0,
        top_k=int32("top_k", s.top_k) if s.top_k else -1,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty != 0.0 else 1.0,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        max_tokens=int32("max_tokens", s.max_tokens) if s.HasField("max_tokens")
        else max_model_len,
        stop=s.stop, stop_token_ids=[int32("stop_token_ids", t) for t in s.stop_token_ids],
        ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output)
    if s.min_tokens:
        out.min_tokens = int32("min_tokens", s.min_tokens)
    if s.HasField("logprobs"):
        out.logprobs = s.logprobs
    if s.HasField("seed"):
        out.seed = s.seed
    out.logit_bias.update(s.logit_bias)
    constraint(s, out.structured_output)
    if not out.structured_output.WhichOneof("constraint"):
        out.ClearField("structured_output")
    return out


def constraint(s: vllm.SamplingParams, out: gen.StructuredOutput) -> None:
    """vLLM's oneof constraint as baton.v1's. It starts at the first output token, which
    is where grammar_from_first_token asks it to start (and where Baton starts one the
    gateway did not shape)."""
    which = s.WhichOneof("constraint")
    if which in ("json_schema", "regex", "grammar"):
        setattr(out, which, getattr(s, which))
    elif which == "json_object":
        out.json_object = s.json_object
    elif which == "choice":
        out.choice.choices.extend(s.choice.choices)
    elif which == "structural_tag":
        raise InvalidArgument("sampling_params.structural_tag: not supported (json_schema, "
                              "json_object, regex, grammar and choice are)")


def choices(request: vllm.GenerateRequest, max_model_len: int, max_n: int
            ) -> list[gen.GenerateRequest]:
    """The baton.v1 request of each choice (n of them): a seeded request gives choice i
    the seed + i, so its choices differ and repeat (as the OpenAI API's do)."""
    refuse_unsupported(request)
    s = request.sampling_params
    n = s.n or 1
    if n > max_n:
        raise InvalidArgument(f"sampling_params.n: {n}; at most {max_n} (--max-n)")
    first = gen.GenerateRequest(request_id=request.request_id, **prompt(request),
                                sampling=sampling(s, max_model_len))
    out = []
    base = request.request_id or uuid.uuid4().hex
    for i in range(n):
        one = gen.GenerateRequest()
        one.CopyFrom(first)
        if n > 1:
            one.request_id = f"{base}-{i}"
            if s.HasField("seed"):
                one.sampling.seed = s.seed + i
        out.append(one)
    return out


def logprobs(entries, top: int | None) -> vllm.OutputLogProbs | None:
    """baton.v1's per-token logprobs (the sampled token first, then the top N, where it
    may recur) as vLLM's: the sampled token's, and with top N > 0 the first N distinct
    tokens of that list (vLLM's own: the sampled token, then the others of its top N)."""
    if top is None or not entries:
        return None
    out = vllm.OutputLogProbs()
    for e in entries:
        sampled = e.entries[0]
        out.token_ids.append(sampled.token_id)
        out.token_logprobs.append(sampled.logprob)
        if top:
            distinct: dict[int, float] = {}
            for x in e.entries:
                distinct.setdefault(x.token_id, x.logprob)
            first = list(distinct.items())[:top]
            out.top_logprobs.add(token_ids=[t for t, _ in first], values=[v for _, v in first])
    return out


class Replies:
    """One choice's baton.v1 replies as vLLM's responses (module docstring)."""

    def __init__(self, index: int, stream: bool, prompt_ids: list[int] | None,
                 top: int | None):
        self.index, self.stream, self.top = index, stream, top
        self.prompt_ids = prompt_ids  # a tokenized prompt's; None for text
        # known for a tokenized prompt; else from the last reply's usage
        self.prompt_tokens = len(prompt_ids) if prompt_ids is not None else 0
        self.done = False
        self.ids: list[int] = []
        self.entries: list = []  # every token's logprobs, for a completion not streamed

    def of(self, reply: gen.GenerateResponse) -> list[vllm.GenerateResponse]:
        d = reply.delta
        out = []
        if reply.HasField("usage"):
            self.prompt_tokens = reply.usage.prompt_tokens
        cached = reply.usage.cached_tokens
        if self.stream and d.token_ids:
            out.append(vllm.GenerateResponse(chunk=vllm.GenerateStreamChunk(
                token_ids=d.token_ids, prompt_tokens=self.prompt_tokens,
                completion_tokens=len(d.token_ids), cached_tokens=cached,
                output_logprobs=logprobs(d.logprobs, self.top), index=self.index)))
        self.ids += d.token_ids
        if not self.stream:
            self.entries += d.logprobs
        if d.finish_reason == gen.FINISH_REASON_UNSPECIFIED:
            return out
        self.done = True
        ids, entries = (d.token_ids, d.logprobs) if self.stream else (self.ids, self.entries)
        done = vllm.GenerateComplete(
            output_ids=ids, finish_reason=FINISH.get(d.finish_reason, "stop"),
            prompt_tokens=self.prompt_tokens, completion_tokens=len(ids),
            cached_tokens=cached, output_logprobs=logprobs(entries, self.top),
            index=self.index)
        which = d.WhichOneof("stop_reason")
        if which == "stop_string":
            done.matched_stop_str = d.stop_string
        elif which == "stop_token_id":
            done.matched_token_id = d.stop_token_id
        out.append(vllm.GenerateResponse(complete=done))
        return out
