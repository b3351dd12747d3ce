"""VllmEngine's Generate request counted on its wire bytes, before protobuf parses it, by
the same walk and the same bounds as baton.v1's (wire.py): the prompt's token ids (and
against the model's length) and its text, the request id, stop strings and their
lengths, stop ids, logit_bias entries, the constraint's size and choices. The fields
Baton refuses (multimodal input, vLLM's KV hand-off) are refused here already, before
any of their bytes are parsed."""

from __future__ import annotations

from collections.abc import Callable

from smg_grpc_proto.generated import vllm_engine_pb2 as vllm

from baton.services.common import constraint_limits
from baton.services.common.limits import TABLE, Limits, check_bound
from baton.services.rpc.errors import InvalidArgument

from .vllm_request import REFUSED
from .wire import LEN, VARINT, Bounded, _chars, _counted, _number, _varints, _Walk

ROW = {row.name: row for row in TABLE}
TOKENIZED, TEXT = _number(vllm.GenerateRequest, "tokenized"), _number(vllm.GenerateRequest,
                                                                       "text")
SAMPLING = _number(vllm.GenerateRequest, "sampling_params")
INPUT_IDS = _number(vllm.TokenizedInput, "input_ids")
ORIGINAL_TEXT = _number(vllm.TokenizedInput, "original_text")
CHOICE, CHOICES = _number(vllm.SamplingParams, "choice"), _number(vllm.ChoiceConstraint,
                                                                   "choices")
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
            if number == INPUT_IDS:  # packed (counted as bytes) or not
                where = "tokenized.input_ids"
                self.add(where, "max_prompt_token_ids",
                         _varints(self.raw, a, b) if kind == LEN else 1)
                most = self.max_model_len
                if most is not None and self.counts[where] >= most:
                    raise InvalidArgument(f"{where}: {self.counts[where]} or more token "
                                          f"ids; max_model_len is {most}")
            elif number == ORIGINAL_TEXT and kind == LEN:
                self.bounded(_row("tokenized.original_text", False, "max_prompt_chars"),
                             kind, a, b)

    def sampling_params(self, start: int, end: int) -> None:
        most = constraint_limits.MAX_CONSTRAINT_CHARS
        for number, kind, a, b in self.fields(start, end, _counted(SAMPLING_BOUNDED)):
            if number in SAMPLING_BOUNDED:
                self.bounded(SAMPLING_BOUNDED[number], kind, a, b)
            elif kind != LEN:
                continue
            elif number in CONSTRAINT_STRINGS and b - a > most:  # no more chars than bytes
                check_bound(f"sampling_params.{CONSTRAINT_STRINGS[number]}",
                            _chars(self.raw, a, b), most, "characters", more=True)
            elif number == CHOICE:
                self.choice(a, b)

    def choice(self, start: int, end: int) -> None:
        where = "sampling_params.choice"
        for number, kind, a, b in self.fields(start, end, frozenset({(CHOICES, LEN)})):
            if number == CHOICES and kind == LEN:
                check_bound(where, self.tally(where, 1), constraint_limits.MAX_CHOICES,
                            "choices", more=True)
                check_bound(where, self.tally(where + " chars", _chars(self.raw, a, b)),
                            constraint_limits.MAX_CONSTRAINT_CHARS, "characters", more=True)


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
