"""The public API's breaking-change check: package baton.v1 as protos/ builds it now,
against baton.v1 as released (protos/baton/v1/released.binpb, a FileDescriptorSet).

    python scripts/proto_compat.py            # `make lint`: each violation on a line, exit 1
    python scripts/proto_compat.py --release  # `make proto-release`: rewrite the released set

A client built against a release must keep working against every later one. So, for each
message of baton.v1 in the released set, every field must still exist with the same number,
name, type, label, type name (messages and enums), oneof and JSON name, or its number and
its name must both be `reserved`; no field may take a number or name the release used for
another field or reserved; what the release reserved stays reserved. Enum values likewise.
Messages, enums, services and methods are never removed, and a method keeps its request and
response types and its streaming. Adding is always allowed. Only baton.v1 is held to this:
baton.worker.v1 is internal and may change between releases.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

from google.protobuf import descriptor_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"
PUBLIC = PROTOS / "baton" / "v1"
RELEASED = PUBLIC / "released.binpb"
PACKAGE = "baton.v1"


def build(files: list[Path]) -> pb.FileDescriptorSet:
    """The descriptor set protoc builds from `files` (under protos/), imports included.
    protoc runs in a process of its own, as `make protos` runs it: its compiler carries its
    own protobuf library, which can crash a process that has loaded torch and upb."""
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.binpb"
        run = subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTOS}", f"-I{well_known}",
             "--include_imports", f"--descriptor_set_out={out}",
             *(f.relative_to(PROTOS).as_posix() for f in files)],
            capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"protoc failed ({run.returncode}):\n{run.stderr}")
        return pb.FileDescriptorSet.FromString(out.read_bytes())


class Package:
    """One package's messages, enums and services, by full name, from a descriptor set."""

    def __init__(self, fds: pb.FileDescriptorSet, package: str = PACKAGE):
        self.messages: dict[str, pb.DescriptorProto] = {}
        self.enums: dict[str, pb.EnumDescriptorProto] = {}
        self.services: dict[str, pb.ServiceDescriptorProto] = {}
        for file in fds.file:
            if file.package != package:
                continue
            for message in file.message_type:
                self._message(package, message)
            for enum in file.enum_type:
                self.enums[f"{package}.{enum.name}"] = enum
            for service in file.service:
                self.services[f"{package}.{service.name}"] = service

    def _message(self, scope: str, message: pb.DescriptorProto) -> None:
        name = f"{scope}.{message.name}"
        self.messages[name] = message
        for enum in message.enum_type:
            self.enums[f"{name}.{enum.name}"] = enum
        for nested in message.nested_type:  # map entries too
            self._message(name, nested)


def _in_ranges(number: int, ranges, inclusive: bool) -> bool:
    # A message's reserved ranges end before `end`; an enum's include it.
    return any(r.start <= number < r.end + inclusive for r in ranges)


def _covered(old_ranges, new_ranges, inclusive: bool) -> list[tuple[int, int]]:
    """The released reserved ranges (as [start, end) pairs) not wholly reserved still."""
    new = sorted((r.start, r.end + inclusive) for r in new_ranges)
    lost = []
    for r in old_ranges:
        start, end = r.start, r.end + inclusive
        for s, e in new:  # walk the sorted ranges, advancing `start` through them
            if s <= start < e:
                start = e
        if start < end:
            lost.append((r.start, r.end))
    return lost


def _reservations(where: str, old, new, inclusive: bool) -> list[str]:
    out = [f"{where}: reserved {s} to {e} is no longer reserved (keep it reserved)"
           for s, e in _covered(old.reserved_range, new.reserved_range, inclusive)]
    out += [f'{where}: reserved "{n}" is no longer reserved (keep it reserved)'
            for n in sorted(set(old.reserved_name) - set(new.reserved_name))]
    return out


def _oneof(message: pb.DescriptorProto, field: pb.FieldDescriptorProto) -> str | None:
    return message.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") \
        else None


def _field_shape(message: pb.DescriptorProto, f: pb.FieldDescriptorProto) -> dict:
    kind = pb.FieldDescriptorProto
    return {"type": kind.Type.Name(f.type), "label": kind.Label.Name(f.label),
            "type name": f.type_name or None, "oneof": _oneof(message, f),
            "JSON name": f.json_name}


def _numbered(name: str, old, new, olds, news, kind: str, inclusive: bool,
              shape=None) -> list[str]:
    """A message's fields or an enum's values (`kind`), old against new: kept with their
    numbers (and `shape`, where given), or reserved by number and name when removed;
    none takes a number or name the release reserved. Enum ranges include their end."""
    out = []
    by_name = {x.name: x for x in news}
    by_number = {x.number: x for x in news}
    for x in olds:
        where = f"{name}.{x.name} = {x.number}"
        y = by_name.get(x.name)
        if y is not None:
            if y.number != x.number:
                out.append(f"{where}: renumbered to {y.number}")
            elif shape is not None:
                was, now = shape(old, x), shape(new, y)
                out += [f"{where}: {k} changed from {was[k]} to {now[k]}"
                        for k in was if was[k] != now[k]]
        elif x.number in by_number:
            out.append(f"{where}: number {x.number} now names `{by_number[x.number].name}` "
                       f'(reserve {x.number} and "{x.name}"; a new {kind} takes a new number)')
        elif not (_in_ranges(x.number, new.reserved_range, inclusive)
                  and x.name in new.reserved_name):
            out.append(f'{where}: removed without `reserved {x.number};` and '
                       f'`reserved "{x.name}";`')
    for y in news:
        if _in_ranges(y.number, old.reserved_range, inclusive) or y.name in old.reserved_name:
            out.append(f"{name}.{y.name} = {y.number}: reuses a number or name the release "
                       "reserved")
    return out + _reservations(name, old, new, inclusive=inclusive)


def _fields(name: str, old: pb.DescriptorProto, new: pb.DescriptorProto) -> list[str]:
    return _numbered(name, old, new, old.field, new.field, "field", False, _field_shape)


def _values(name: str, old: pb.EnumDescriptorProto, new: pb.EnumDescriptorProto) -> list[str]:
    return _numbered(name, old, new, old.value, new.value, "value", True)


def _methods(name: str, old: pb.ServiceDescriptorProto,
             new: pb.ServiceDescriptorProto) -> list[str]:
    out = []
    now = {m.name: m for m in new.method}
    for m in old.method:
        where = f"{name}/{m.name}"
        n = now.get(m.name)
        if n is None:
            out.append(f"{where}: method removed")
            continue
        for k in ("input_type", "output_type", "client_streaming", "server_streaming"):
            if getattr(m, k) != getattr(n, k):
                out.append(f"{where}: {k} changed from {getattr(m, k)} to {getattr(n, k)}")
    return out


def violations(released: pb.FileDescriptorSet, current: pb.FileDescriptorSet,
               package: str = PACKAGE) -> list[str]:
    """Every way `current` breaks what `released` promised of `package`, one line each."""
    old, new = Package(released, package), Package(current, package)
    out = []
    for kind, check in (("messages", _fields), ("enums", _values), ("services", _methods)):
        was, now = getattr(old, kind), getattr(new, kind)
        for name in sorted(was):
            if name not in now:
                out.append(f"{name}: {kind[:-1]} removed")
            else:
                out += check(name, was[name], now[name])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--release", action="store_true",
                        help="write baton.v1 as it stands as the released set (at a release)")
    args = parser.parse_args(argv)
    rel = RELEASED.relative_to(ROOT)
    if args.release:
        RELEASED.write_bytes(build(sorted(PUBLIC.glob("*.proto"))).SerializeToString(
            deterministic=True))
        print(f"proto_compat: wrote {rel}: baton.v1 as released; commit it")
        return 0
    released = pb.FileDescriptorSet.FromString(RELEASED.read_bytes())
    # Every .proto: a baton.v1 declaration is held to the release wherever it lives.
    current = build(sorted(PROTOS.rglob("*.proto")))
    bad = violations(released, current)
    if bad:
        print(f"proto_compat: baton.v1 breaks what {rel} released "
              f"({len(bad)} violation{'s' * (len(bad) != 1)}):")
        print("\n".join(f"  {line}" for line in bad))
        print("Reserve what goes (`reserved N;` and `reserved \"name\";`), give new fields new "
              "numbers; a deliberate break is a new package (baton.v2).")
        return 1
    kept = Package(released)
    print(f"proto_compat: baton.v1 keeps what {rel} released (messages {len(kept.messages)}, "
          f"enums {len(kept.enums)}, services {len(kept.services)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
