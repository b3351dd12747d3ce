"""VllmEngine's Generate request counted on its wire bytes, before protobuf parses it, by
the same walk and the same bounds as baton.v1's (wire.py): the prompt's token ids (and
against the model's length) and its text, the request id, stop strings and their
lengths, stop ids, logit_bias entries, the constraint's size and choices. The fields
Baton refuses (multimodal input, vLLM's KV hand-off) are refused here already, before
any of their bytes are parsed."""

from __future__ import annotations

from collections.abc import Callable

from smg_grpc_proto.generated import vllm_engine_pb2 as vllm

from baton.services.common.limits import TABLE, Limits
from baton.services.rpc.errors import InvalidArgument

from .vllm_request import REFUSED
from .wire import CHOICES, LEN, VARINT, Bounded, _counted, _number, _Walk

ROW = {row.name: row for row in TABLE}
TOKENIZED, TEXT = _number(vllm.GenerateRequest, "tokenized"), _number(vllm.GenerateRequest,
                                                                       "text")
SAMPLING = _number(vllm.GenerateRequest, "sampling_params")
INPUT_IDS = _number(vllm.TokenizedInput, "input_ids")
ORIGINAL_TEXT = _number(vllm.TokenizedInput, "original_text")
CHOICE = _number(vllm.SamplingParams, "choice")
# Its choices are walked as baton.v1's Choices are (wire.py): the same field number.
assert _number(vllm.ChoiceConstraint, "choices") == CHOICES
NOT_TAKEN = {_number(vllm.GenerateRequest, name): name for name in REFUSED}
CONSTRAINT_STRINGS = {_number(vllm.SamplingParams, name): name
                      for name in ("json_schema", "regex", "grammar", "structural_tag")}


def _row(where: str, ints: bool, *names: str) -> Bounded:
    return Bounded(where, ints, tuple(ROW[n] for n in names), VARINT if ints else LEN)


REQUEST_BOUNDED = {_number(vllm.GenerateRequest, "request_id"):
                   _row("request_id", False, "max_request_id_chars"),
                   TEXT: _row("text", False, "max_prompt_chars")}
SAMPLING_BOUNDED = {
    _number(vllm.SamplingParams, "stop"):
        _row("sampling_params.stop", False, "max_stop", "max_stop_chars"),
    _number(vllm.SamplingParams, "stop_token_ids"):
        _row("sampling_params.stop_token_ids", True, "max_stop_token_ids"),
    _number(vllm.SamplingParams, "logit_bias"):
        _row("sampling_params.logit_bias", False, "logit_bias")}


class _VllmWalk(_Walk):
    def tokenized(self, start: int, end: int) -> None:
        for number, kind, a, b in self.fields(start, end, frozenset({(INPUT_IDS, VARINT)})):
            if number == INPUT_IDS:
                self.prompt_ids("tokenized.input_ids", kind, a, b)
            elif number == ORIGINAL_TEXT and kind == LEN:
                self.bounded(_row("tokenized.original_text", False, "max_prompt_chars"),
                             kind, a, b)

    def sampling_params(self, start: int, end: int) -> None:
        for number, kind, a, b in self.fields(start, end, _counted(SAMPLING_BOUNDED)):
            if number in SAMPLING_BOUNDED:
                self.bounded(SAMPLING_BOUNDED[number], kind, a, b)
            elif kind != LEN:
                continue
            elif number in CONSTRAINT_STRINGS:
                self.constraint_text(f"sampling_params.{CONSTRAINT_STRINGS[number]}", a, b)
            elif number == CHOICE:
                self.choices(a, b, "sampling_params.choice")


def check_generate(limits: Limits, max_model_len: Callable[[], int | None] = lambda: None
                   ) -> Callable[[bytes], None]:
    """The raw check of VllmEngine's Generate (module docstring)."""
    def check(raw: bytes) -> None:
        walk = _VllmWalk(raw, limits, max_model_len())
        for number, kind, a, b in walk.fields(0, len(raw), _counted(REQUEST_BOUNDED)):
            if number in REQUEST_BOUNDED:
                walk.bounded(REQUEST_BOUNDED[number], kind, a, b)
            elif number in NOT_TAKEN:
                name = NOT_TAKEN[number]
                raise InvalidArgument(f"{name}: {REFUSED[name]}")
            elif kind != LEN:
                continue
            elif number == TOKENIZED:
                walk.tokenized(a, b)
            elif number == SAMPLING:
                walk.sampling_params(a, b)

    return check
