"""Every service, rpc, message, enum, value, oneof and field of the protos says what it
means in a `//` comment on the lines just above it, as the wire contract's only docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2] / "protos"
PROTOS = sorted(ROOT.rglob("*.proto"))  # baton/v1 (public) and baton/worker/v1 (internal)
DECLARATION = re.compile(r"^\s*(service|rpc|message|enum|oneof)\s+\w+"
                         r"|^\s*(optional\s+|repeated\s+)?[\w.]+\s+\w+\s*=\s*\d+;"
                         r"|^\s*[A-Z][A-Z0-9_]*\s*=\s*\d+;")


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_declaration_has_a_comment_above_it(proto):
    lines = proto.read_text().splitlines()
    bare = [f"{proto.name}:{i + 1}: {line.strip()}" for i, line in enumerate(lines)
            if DECLARATION.match(line) and not (i and lines[i - 1].strip().startswith("//"))]
    assert not bare, "undocumented:\n" + "\n".join(bare)
