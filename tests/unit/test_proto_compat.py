"""scripts/proto_compat.py, the check `make lint` holds baton.v1 to: each breaking change is
caught and named, and what a release may do (add; remove with `reserved`) passes. The sets
are FileDescriptorProtos built here and edited; one test runs the script on the real protos."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("proto_compat", ROOT / "scripts" / "proto_compat.py")
compat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compat)

F = pb.FieldDescriptorProto


def released() -> pb.FileDescriptorSet:
    """A small baton.v1: a message with a scalar, a string, a message and a repeated field,
    an enum, a service; and an internal package beside it."""
    fds = pb.FileDescriptorSet()
    f = fds.file.add(name="baton/v1/api.proto", package="baton.v1", syntax="proto3")
    m = f.message_type.add(name="Request")
    m.field.add(name="count", number=1, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL,
                json_name="count")
    m.field.add(name="text", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL,
                json_name="text")
    m.field.add(name="inner", number=3, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
                type_name=".baton.v1.Inner", json_name="inner")
    m.field.add(name="ids", number=4, type=F.TYPE_INT32, label=F.LABEL_REPEATED,
                json_name="ids")
    f.message_type.add(name="Inner").field.add(name="x", number=1, type=F.TYPE_INT32,
                                               label=F.LABEL_OPTIONAL, json_name="x")
    e = f.enum_type.add(name="Mode")
    e.value.add(name="MODE_UNSPECIFIED", number=0)
    e.value.add(name="MODE_FAST", number=1)
    e.value.add(name="MODE_SLOW", number=2)
    s = f.service.add(name="Api")
    s.method.add(name="Call", input_type=".baton.v1.Request", output_type=".baton.v1.Inner")
    w = fds.file.add(name="baton/worker/v1/w.proto", package="baton.worker.v1",
                     syntax="proto3")
    w.message_type.add(name="Internal").field.add(name="y", number=1, type=F.TYPE_INT32,
                                                  label=F.LABEL_OPTIONAL, json_name="y")
    return fds


def edited(change) -> list[str]:
    current = released()
    change(current.file[0], current)
    return compat.violations(released(), current)


def _request(file: pb.FileDescriptorProto) -> pb.DescriptorProto:
    return file.message_type[0]


def _field(file: pb.FileDescriptorProto, name: str) -> pb.FieldDescriptorProto:
    return next(f for f in _request(file).field if f.name == name)


def _remove(message: pb.DescriptorProto, name: str) -> None:
    message.field.remove(next(f for f in message.field if f.name == name))


def test_the_unchanged_set_passes():
    assert compat.violations(released(), released()) == []


def test_a_renumbered_field_fails():
    bad = edited(lambda f, _: setattr(_field(f, "text"), "number", 7))
    assert bad == ["baton.v1.Request.text = 2: renumbered to 7"]


def test_a_field_removed_without_reserved_fails():
    bad = edited(lambda f, _: _remove(_request(f), "text"))
    assert bad == ['baton.v1.Request.text = 2: removed without `reserved 2;` and '
                   '`reserved "text";`']


@pytest.mark.parametrize("what,change,said", [
    ("type", lambda f: setattr(_field(f, "count"), "type", F.TYPE_INT64),
     "type changed from TYPE_INT32 to TYPE_INT64"),
    ("label", lambda f: setattr(_field(f, "count"), "label", F.LABEL_REPEATED),
     "label changed from LABEL_OPTIONAL to LABEL_REPEATED"),
    ("message type", lambda f: setattr(_field(f, "inner"), "type_name", ".baton.v1.Request"),
     "type name changed from .baton.v1.Inner to .baton.v1.Request"),
])
def test_a_changed_type_fails(what, change, said):
    bad = edited(lambda f, _: change(f))
    assert len(bad) == 1 and said in bad[0], (what, bad)


def test_a_reused_number_fails():
    def reuse(f, _):
        _remove(_request(f), "text")
        _request(f).field.add(name="title", number=2, type=F.TYPE_STRING,
                              label=F.LABEL_OPTIONAL, json_name="title")
    bad = edited(reuse)
    assert len(bad) == 1 and bad[0].startswith(
        "baton.v1.Request.text = 2: number 2 now names `title`"), bad


def test_a_new_field_passes():
    assert edited(lambda f, _: _request(f).field.add(
        name="extra", number=5, type=F.TYPE_BOOL, label=F.LABEL_OPTIONAL,
        json_name="extra")) == []


def _reserve_text(f: pb.FileDescriptorProto, _=None, name: bool = True) -> None:
    _remove(_request(f), "text")
    _request(f).reserved_range.add(start=2, end=3)
    if name:
        _request(f).reserved_name.append("text")


def test_a_field_removed_with_reserved_passes():
    assert edited(_reserve_text) == []
    # Its number alone is not enough: a new field could take the name.
    bad = edited(lambda f, _: _reserve_text(f, name=False))
    assert len(bad) == 1 and "removed without" in bad[0], bad


def test_a_reserved_number_or_name_stays_reserved():
    before = released()
    _reserve_text(before.file[0])
    after = released()
    _remove(_request(after.file[0]), "text")
    _request(after.file[0]).field.add(name="text", number=9, type=F.TYPE_STRING,
                                      label=F.LABEL_OPTIONAL, json_name="text")
    bad = compat.violations(before, after)
    assert any("reuses a number or name the release reserved" in b for b in bad), bad
    assert any("reserved 2 to 3 is no longer reserved" in b for b in bad), bad
    assert any('reserved "text" is no longer reserved' in b for b in bad), bad


def test_enum_values_are_held_alike():
    def mode(f):
        return f.enum_type[0]
    renumbered = edited(lambda f, _: setattr(mode(f).value[1], "number", 5))
    assert renumbered == ["baton.v1.Mode.MODE_FAST = 1: renumbered to 5"]
    removed = edited(lambda f, _: mode(f).value.remove(mode(f).value[2]))
    assert len(removed) == 1 and "removed without `reserved 2;`" in removed[0], removed

    def reserved(f, _):
        mode(f).value.remove(mode(f).value[2])
        mode(f).reserved_range.add(start=2, end=2)  # an enum's range includes its end
        mode(f).reserved_name.append("MODE_SLOW")
    assert edited(reserved) == []

    def reused(f, _):
        mode(f).value[2].name = "MODE_SLOWER"
    bad = edited(reused)
    assert len(bad) == 1 and "number 2 now names `MODE_SLOWER`" in bad[0], bad


def test_services_and_methods_are_held():
    def method(f):
        return f.service[0].method[0]
    assert edited(lambda f, _: setattr(method(f), "output_type", ".baton.v1.Request")) == [
        "baton.v1.Api/Call: output_type changed from .baton.v1.Inner to .baton.v1.Request"]
    assert edited(lambda f, _: setattr(method(f), "server_streaming", True)) == [
        "baton.v1.Api/Call: server_streaming changed from False to True"]
    assert edited(lambda f, _: f.service[0].method.remove(method(f))) == [
        "baton.v1.Api/Call: method removed"]
    assert edited(lambda f, _: f.service.remove(f.service[0])) == [
        "baton.v1.Api: service removed"]
    assert edited(lambda f, _: f.service[0].method.add(
        name="More", input_type=".baton.v1.Inner", output_type=".baton.v1.Inner")) == []


def test_the_internal_package_is_free_to_change():
    assert edited(lambda _, s: s.file[1].message_type[0].ClearField("field")) == []
    # ... but a message moved out of baton.v1 is a message removed from it.
    def move(f, s):
        s.file[1].message_type.add().CopyFrom(f.message_type[1])
        f.message_type.remove(f.message_type[1])
    assert edited(move) == ["baton.v1.Inner: message removed"]
