"""scripts/proto_compat.py on the real protos, as `make lint` runs it
(tests/unit/test_proto_compat.py checks its rules)."""

from __future__ import annotations

from google.protobuf import descriptor_pb2 as pb

from tests.unit.test_proto_compat import compat

F = pb.FieldDescriptorProto



def test_the_script_on_the_real_protos(tmp_path, monkeypatch, capsys):
    # The committed release holds now; a release with a field the protos lack fails, with
    # that field named on its own line and a non-zero exit.
    assert compat.main([]) == 0
    fds = pb.FileDescriptorSet.FromString(compat.RELEASED.read_bytes())
    request = next(m for f in fds.file if f.package == "baton.v1" for m in f.message_type
                   if m.name == "GenerateRequest")
    number = max(f.number for f in request.field) + 1
    request.field.add(name="gone_field", number=number, type=F.TYPE_INT32,
                      label=F.LABEL_OPTIONAL, json_name="goneField")
    monkeypatch.setattr(compat, "RELEASED", tmp_path / "released.binpb")
    monkeypatch.setattr(compat, "ROOT", tmp_path)
    compat.RELEASED.write_bytes(fds.SerializeToString())
    capsys.readouterr()
    assert compat.main([]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"  baton.v1.GenerateRequest.gone_field = {number}: removed without " \
           f'`reserved {number};` and `reserved "gone_field";`' in out, out
