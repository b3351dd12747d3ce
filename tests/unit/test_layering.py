"""The import rules of shared/DESIGN.md: which top-level folder may import which."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = {"protos", "baton", "services", "router", "prefill_worker", "decode_worker",
        "kv_transfer", "kernels"}
ALLOWED = {  # folder -> project packages (dotted prefixes) it may import, besides itself
    "kernels": set(),
    "protos": set(),
    "services": {"kernels", "protos", "baton"},
    "router": {"protos", "baton", "services.serving"},
    "prefill_worker": {"services", "kv_transfer", "kernels", "protos", "baton"},
    "decode_worker": {"services", "kv_transfer", "kernels", "protos", "baton"},
    "kv_transfer": {"services.engine"},
}
FORBIDDEN_THIRD_PARTY = {"router": {"torch"}}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_folders_import_only_what_design_allows():
    bad = []
    for folder, allowed in ALLOWED.items():
        for path in (ROOT / folder).rglob("*.py"):
            for name in _imports(path):
                top = name.split(".")[0]
                if top in FORBIDDEN_THIRD_PARTY.get(folder, ()):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
                if top not in OURS or top == folder:
                    continue
                if not any(name == a or name.startswith(a + ".") for a in allowed):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_the_check_sees_a_violation(tmp_path):
    # Guard against a check that cannot fail: a router file importing torch is caught.
    f = tmp_path / "x.py"
    f.write_text("import torch\nfrom services.engine import LLM\n")
    assert _imports(f) == ["torch", "services.engine"]
