"""Every overload refusal carries the retry hint because there is one way to send one:
raise AtCapacity / Overloaded, which the interceptor's `_abort` answers with
`retry-after-ms` (tests/integration/test_server.py). This holds the code to that: no
other place in the product sends RESOURCE_EXHAUSTED itself, and no server leaves the
refusal to gRPC's `maximum_concurrent_rpcs`, which answers without trailing metadata (a
burst against a router once got 8 of 18 refusals without the hint that way). gRPC's own
refusal of an oversized message is RESOURCE_EXHAUSTED too, but no overload: retrying it
cannot help, and it carries no hint."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("router", "services", "decode_worker", "prefill_worker", "cli", "kv_transfer",
           "baton_client", "kernels", "tools")
SENDERS = {"abort", "set_code", "abort_with_status"}


def _offences(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else \
            getattr(node.func, "id", "")
        sends = name in SENDERS and "RESOURCE_EXHAUSTED" in ast.unparse(node)
        if sends or any(k.arg == "maximum_concurrent_rpcs" for k in node.keywords):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_overload_refusal_is_sent_but_through_the_interceptor():
    files = [p for top in PRODUCT for p in (ROOT / top).rglob("*.py")]
    assert len(files) > 100  # the product was found
    assert [o for p in files for o in _offences(p)] == []


def test_the_check_finds_a_refusal_sent_by_hand(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("async def f(context, grpc):\n"
                   "    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, 'full')\n"
                   "def g(grpc):\n    return grpc.aio.server(maximum_concurrent_rpcs=4)\n")
    assert sorted(o.split(":")[1] for o in _offences(bad, tmp_path)) == ["2", "4"]
