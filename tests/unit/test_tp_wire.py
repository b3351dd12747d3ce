"""The tensor-parallel message format: a step (with LoRA weights) comes back field for
field and tensor for tensor; a pickle, a message of another version, a tensor past the
end and a field of the wrong type are refused, and nothing in them runs."""

from __future__ import annotations

import pickle
import struct

import pytest
import torch

from baton.services.engine.forward import Forward
from baton.services.engine.tp_wire import MAGIC, WireError, decode, encode
from baton.services.lora.adapter import LoRAAdapter

RAN: list[str] = []


class Payload:
    """What an attacker pickles: unpickling it calls RAN.append."""

    def __reduce__(self):
        return (RAN.append, ("code ran",))


def step(**kw) -> Forward:
    a, b = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(32, 4, dtype=torch.bfloat16)
    adapter = LoRAAdapter("tuned", "/adapters/tuned", 4, {(0, "qkv", 1): (a, b)})
    fields = dict(ids=[5, 9, 11], positions=[0, 1, 7], qsl=[0, 2, 3], seq_lens=[2, 8],
                  tables=[[3], [4, 6]], num_decodes=1, max_query_len=2, rows=[1, 2],
                  logits=True, lora_tokens=[-1, 0, 0], lora_writes=[(2, adapter)])
    return Forward(**{**fields, **kw})


def test_a_step_comes_back_whole_with_its_lora_weights():
    sent = step()
    kind, args = decode(encode("forward", sent.to_wire()))
    got = Forward.from_wire(args[0])
    assert kind == "forward"
    plain = ("ids", "positions", "qsl", "seq_lens", "tables", "num_decodes",
             "max_query_len", "rows", "logits", "lora_tokens")
    assert [getattr(got, f) for f in plain] == [getattr(sent, f) for f in plain]
    (slot, adapter), = got.lora_writes
    (a, b), = sent.lora_writes[0][1].weights.values()
    assert slot == 2 and adapter.name == "tuned" and adapter.rank == 4
    got_a, got_b = adapter.weights[0, "qkv", 1]
    assert got_a.dtype == torch.bfloat16 and torch.equal(got_a, a) and torch.equal(got_b, b)
    no_rows = Forward.from_wire(decode(encode("forward", step(rows=None).to_wire()))[1][0])
    assert no_rows.rows is None


def test_plain_messages_come_back():
    assert decode(encode("allocate", 12, None)) == ("allocate", [12, None])
    assert decode(encode("allocate", 12, "baton-kv-1")) == ("allocate", [12, "baton-kv-1"])
    assert decode(encode("capture", 8, 512)) == ("capture", [8, 512])
    assert decode(encode("stop")) == ("stop", [])


def test_a_pickle_is_refused_unread():
    for data in (pickle.dumps(("forward", Payload())), pickle.dumps(Payload(), protocol=5)):
        with pytest.raises(WireError, match="not a Baton tensor-parallel message"):
            decode(data)
    assert RAN == []


def test_a_message_of_another_version_or_cut_short_is_refused():
    good = encode("stop")
    with pytest.raises(WireError, match="version 2"):
        decode(MAGIC + struct.pack("<H", 2) + good[6:])
    with pytest.raises(WireError, match="shorter than its header"):
        decode(good[:5])
    with pytest.raises(WireError, match="runs past its end"):
        decode(good[:-1])
    wire = encode("forward", step().to_wire())
    with pytest.raises(WireError, match="a tensor runs past its end"):
        decode(wire[:-3])


def frame(meta: bytes, blob: bytes = b"") -> bytes:
    return MAGIC + struct.pack("<HI", 1, len(meta)) + meta + blob


@pytest.mark.parametrize("meta, why", [
    (b'{"kind": "exec", "args": [], "tensors": []}', "unknown tensor-parallel message"),
    (b'{"kind": "allocate", "args": ["12", null], "tensors": []}', "wrong shape"),
    (b'{"kind": "allocate", "args": [true, null], "tensors": []}', "wrong shape"),
    (b'{"kind": "capture", "args": [1], "tensors": []}', "wrong shape"),
    (b'{"kind": "stop", "args": [], "tensors": [], "x": 1}', "must hold kind"),
    (b'{"kind": "stop", "args": [{"tensor": 0}], "tensors": []}', "no tensor 0"),
    (b'{"kind": "stop", "args": [], "tensors": [["object", [1], 0]]}', "bad tensor entry"),
    (b'{"kind": "stop", "args": [], "tensors": [["float32", [-1], 0]]}', "bad tensor entry"),
    (b"\x80\x04", "not JSON"),
])
def test_a_message_that_breaks_its_schema_is_refused(meta, why):
    with pytest.raises(WireError, match=why):
        decode(frame(meta))


@pytest.mark.parametrize("field, value", [
    ("ids", ["5"]), ("ids", [1.5]), ("ids", [True]), ("tables", []), ("tables", [[1, "x"]]),
    ("num_decodes", 1.0), ("logits", 1), ("rows", {"a": 1}), ("lora_writes", {}),
    ("lora_writes", [[0, "a", [[0, "exec", 0, {"tensor": 0}, {"tensor": 0}]]]]),
])
def test_a_step_with_a_field_of_the_wrong_type_is_refused(field, value):
    wire = step(lora_writes=[]).to_wire()
    wire[field] = value
    with pytest.raises(WireError):
        Forward.from_wire(decode(encode("forward", wire))[1][0])
    extra = {**step(lora_writes=[]).to_wire(), "code": "x"}
    with pytest.raises(WireError, match="fields"):
        Forward.from_wire(extra)
