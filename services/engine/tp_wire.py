"""What rank 0 sends the other tensor-parallel ranks, as bytes: a fixed, versioned format
that is parsed, never unpickled, so the bytes a peer sends can make a rank run a step of
the model and nothing else.

    | magic "BTTP" | version u16 | meta length u32 | meta (JSON, UTF-8) | tensor bytes |
      4 bytes        2             4                 meta length          the rest

    meta = {"kind": "forward", "args": [...], "tensors": [[dtype, [shape...], offset], ...]}

The arguments are JSON values (numbers, strings, lists, objects, null); a tensor among
them stands as {"tensor": i}, entry i of "tensors", whose bytes start at `offset` of the
tensor bytes (its size follows from dtype and shape). `decode` checks the frame, then
each kind's arguments against its schema (`Forward.from_wire` for a step), and raises
WireError on anything else: a message of another version, a pickle, a tensor past the
end, a field of the wrong type.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

MAGIC = b"BTTP"
VERSION = 1
HEAD = struct.Struct("<4sHI")
# The dtypes a message may carry (LoRA weights, in the model's dtype).
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8)}
# The messages and their plain arguments' types ("forward" carries a Forward: forward.py).
KINDS: dict[str, tuple[tuple[type, ...], ...]] = {
    "ping": (), "stop": (), "weights": (), "profile": (),
    "allocate": ((int,), (str, type(None))),  # blocks, the shared cache's name or None
    "capture": ((int,), (int,)),  # max_num_seqs, max_model_len
    "forward": ((dict,),),
}


class WireError(ValueError):
    """Bytes that are not a message of this version, or a message that breaks its schema."""


def encode(kind: str, *args: Any) -> bytes:
    """`args` hold JSON values and tensors (anywhere inside lists and dicts)."""
    tensors: list[list] = []
    blobs: list[bytes] = []
    offset = 0

    def plain(x):
        nonlocal offset
        if isinstance(x, torch.Tensor):
            t = x.detach().contiguous().cpu()
            data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
            tensors.append([str(t.dtype).removeprefix("torch."), list(t.shape), offset])
            blobs.append(data)
            offset += len(data)
            return {"tensor": len(tensors) - 1}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    meta = json.dumps({"kind": kind, "args": plain(list(args)), "tensors": tensors},
                      separators=(",", ":")).encode()
    return b"".join([HEAD.pack(MAGIC, VERSION, len(meta)), meta, *blobs])


def decode(data: bytes | memoryview) -> tuple[str, list]:
    """(kind, args) of a message, its tensors rebuilt and its arguments checked."""
    data = memoryview(data)
    if len(data) < HEAD.size:
        raise WireError(f"a tensor-parallel message of {len(data)} bytes: shorter than its "
                        "header")
    magic, version, meta_len = HEAD.unpack(data[:HEAD.size])
    if magic != MAGIC:
        raise WireError("not a Baton tensor-parallel message (no BTTP header): refused, "
                        "unread")
    if version != VERSION:
        raise WireError(f"tensor-parallel message version {version}; this rank reads "
                        f"{VERSION} only (every rank must run the same Baton)")
    body = HEAD.size + meta_len
    if body > len(data):
        raise WireError("tensor-parallel message: its meta runs past its end")
    try:
        meta = json.loads(bytes(data[HEAD.size:body]))
    except ValueError as e:
        raise WireError(f"tensor-parallel message: meta is not JSON ({e})") from None
    if not isinstance(meta, dict) or set(meta) != {"kind", "args", "tensors"}:
        raise WireError("tensor-parallel message: meta must hold kind, args and tensors")
    kind, args = meta["kind"], meta["args"]
    if kind not in KINDS or not isinstance(args, list):
        raise WireError(f"unknown tensor-parallel message {kind!r}")
    tensors = _tensors(meta["tensors"], data[body:])
    args = [_rebuild(a, tensors) for a in args]
    want = KINDS[kind]
    if len(args) != len(want) or not all(
            isinstance(a, types) and not (isinstance(a, bool) and bool not in types)
            for a, types in zip(args, want, strict=False)):
        raise WireError(f"tensor-parallel message {kind!r}: arguments of the wrong shape")
    return kind, args


def _tensors(specs, blob: memoryview) -> list[torch.Tensor]:
    if not isinstance(specs, list):
        raise WireError("tensor-parallel message: tensors must be a list")
    out = []
    for spec in specs:
        if not (isinstance(spec, list) and len(spec) == 3 and spec[0] in DTYPES
                and isinstance(spec[1], list) and all(_count(n) for n in spec[1])
                and _count(spec[2])):
            raise WireError(f"tensor-parallel message: bad tensor entry {str(spec)[:80]}")
        dtype, shape, offset = DTYPES[spec[0]], spec[1], spec[2]
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset + size > len(blob):
            raise WireError("tensor-parallel message: a tensor runs past its end")
        raw = torch.frombuffer(bytearray(blob[offset:offset + size]), dtype=torch.uint8) \
            if size else torch.empty(0, dtype=torch.uint8)
        out.append(raw.view(dtype).reshape(shape))
    return out


def _rebuild(x, tensors: list[torch.Tensor]):
    if isinstance(x, list):
        return [_rebuild(v, tensors) for v in x]
    if isinstance(x, dict):
        if set(x) == {"tensor"}:
            i = x["tensor"]
            if not _count(i) or i >= len(tensors):
                raise WireError(f"tensor-parallel message: no tensor {str(i)[:20]}")
            return tensors[i]
        return {k: _rebuild(v, tensors) for k, v in x.items()}
    return x


def _count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def ints(x, name: str) -> list[int]:
    """`x` as a list of ints, or WireError naming the field."""
    if not isinstance(x, list) or not all(type(v) is int for v in x):
        raise WireError(f"tensor-parallel step: {name} must be a list of integers")
    return x


def ints_or_none(x, name: str) -> list[int] | None:
    return None if x is None else ints(x, name)
