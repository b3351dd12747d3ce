"""The import rules of shared/DESIGN.md: which top-level folder may import which."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = {"protos", "baton", "services", "router", "prefill_worker", "decode_worker",
        "kv_transfer", "kernels"}
ALLOWED = {  # folder -> project packages (dotted prefixes) it may import, besides itself
    "kernels": set(),
    "protos": {"baton"},  # generated stubs import each other as baton.v1.*
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


def _violations(root: Path) -> list[str]:
    bad = []
    for folder, allowed in ALLOWED.items():
        for path in (root / folder).rglob("*.py"):
            for name in _imports(path):
                top = name.split(".")[0]
                if top in FORBIDDEN_THIRD_PARTY.get(folder, ()):
                    bad.append(f"{path.relative_to(root)} imports {name}")
                if top not in OURS or top == folder:
                    continue
                if not any(name == a or name.startswith(a + ".") for a in allowed):
                    bad.append(f"{path.relative_to(root)} imports {name}")
    return bad


def test_folders_import_only_what_design_allows():
    bad = _violations(ROOT)
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_the_check_sees_violations(tmp_path):
    # Guard against a check that cannot fail: a router importing torch and the engine, and
    # a decode worker importing the prefill worker, are all caught; allowed imports pass.
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "x.py").write_text(
        "import torch\nfrom services.engine import LLM\nfrom services.serving import a\n")
    (tmp_path / "decode_worker").mkdir()
    (tmp_path / "decode_worker" / "y.py").write_text(
        "import prefill_worker.z\nimport kv_transfer\n")
    assert sorted(_violations(tmp_path)) == [
        "decode_worker/y.py imports prefill_worker.z",
        "router/x.py imports services.engine",
        "router/x.py imports torch",
    ]
