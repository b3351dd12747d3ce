"""The package baton.v1 holds only what clients call: the one service Generation and the
messages it reaches. The workers' internal services are package baton.worker.v1, which may
import baton.v1 and never the reverse; health and reflection are gRPC's own packages.
Read from the file descriptors of every generated module under protos/baton."""

from __future__ import annotations

import importlib
from pathlib import Path

from google.protobuf.descriptor import Descriptor, FileDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

import baton

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "protos"
PUBLIC, INTERNAL = "baton.v1", "baton.worker.v1"


def files() -> dict[str, list[FileDescriptor]]:
    """Every generated module's file descriptor, by proto package."""
    out: dict[str, list[FileDescriptor]] = {}
    for path in sorted((STUBS / "baton").rglob("*_pb2.py")):
        name = path.relative_to(STUBS).with_suffix("").as_posix().replace("/", ".")
        fd = importlib.import_module(name).DESCRIPTOR
        out.setdefault(fd.package, []).append(fd)
    return out


def services(package: str) -> set[str]:
    return {s.full_name for fd in files().get(package, []) for s in fd.services_by_name.values()}


def _reached(message: Descriptor, seen: set[str]) -> None:
    if message.full_name in seen:
        return
    seen.add(message.full_name)
    for nested in message.nested_types:
        _reached(nested, seen)
    seen.update(e.full_name for e in message.enum_types)
    for field in message.fields:
        if field.message_type is not None:
            _reached(field.message_type, seen)
        if field.enum_type is not None:
            seen.add(field.enum_type.full_name)


def test_the_public_package_serves_only_generation():
    assert services(PUBLIC) == {"baton.v1.Generation"}
    assert services(INTERNAL) == {"baton.worker.v1.PrefillService",
                                  "baton.worker.v1.DecodeService",
                                  "baton.worker.v1.WorkerService"}
    # Health and reflection, served beside them on every process, are gRPC's own packages.
    assert health_pb2.DESCRIPTOR.services_by_name["Health"].full_name == \
        "grpc.health.v1.Health"
    assert reflection.SERVICE_NAME.rpartition(".")[0] == "grpc.reflection.v1alpha"
    assert {p for p in files() if p.startswith("baton")} == {PUBLIC, INTERNAL}


def test_every_public_message_is_reached_from_generation():
    # A baton.v1 message or enum that Generation's requests and responses never reach is
    # there only for the workers, and belongs to baton.worker.v1.
    public = files()[PUBLIC]
    [generation] = [fd.services_by_name["Generation"] for fd in public
                    if "Generation" in fd.services_by_name]
    reached: set[str] = set()
    for method in generation.methods:
        _reached(method.input_type, reached)
        _reached(method.output_type, reached)
    declared = {m.full_name for fd in public for m in fd.message_types_by_name.values()}
    declared |= {e.full_name for fd in public for e in fd.enum_types_by_name.values()}
    assert declared, "no baton.v1 message found"
    assert declared - reached == set(), "baton.v1 declares what no client call reaches"


def test_the_public_package_imports_nothing_internal():
    # Internal may depend on public (shared messages), never the reverse.
    for fd in files()[PUBLIC]:
        deps = {d.package for d in fd.dependencies}
        assert deps <= {PUBLIC, "google.protobuf"}, (fd.name, deps)
    assert any(d.package == PUBLIC for fd in files()[INTERNAL] for d in fd.dependencies)


def test_baton_worker_is_only_the_generated_stubs():
    # protos/baton links the top-level code folders in as baton.<folder>; baton.worker is
    # the stubs' own folder, and no top-level folder (or link to one) shares its name.
    import baton.worker.v1.worker_pb2 as wk

    stubs = STUBS / "baton" / "worker"
    assert stubs.is_dir() and not stubs.is_symlink()
    assert not (ROOT / "worker").exists()
    assert [Path(p) for p in baton.__path__ if (Path(p) / "worker").exists()] == \
        [STUBS / "baton"]
    assert Path(wk.__file__).resolve().is_relative_to(stubs)
