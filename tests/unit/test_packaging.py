"""What `pip install baton[http]` (the router's image, a client's machine) pulls in: the
requirement graph of the base install and the extra, resolved through the installed
distributions' own metadata, holds no torch (nor CUDA libraries)."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")

ROOT = Path(__file__).resolve().parents[2]
HEAVY = re.compile(r"^(torch|triton|nvidia-.*|nixl.*|gguf)$")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(requirements: list[str]) -> tuple[set[str], set[str]]:
    """Every distribution those requirements reach (markers evaluated for this machine,
    extras followed), and those that are not installed here (unresolved)."""
    seen: set[tuple[str, str]] = set()
    found, missing = set(), set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = _norm(req.name)
        for want in sorted(req.extras) or [""]:
            if (name, want) in seen:
                continue
            seen.add((name, want))
            found.add(name)
            try:
                requires = metadata.requires(req.name) or []
            except metadata.PackageNotFoundError:
                missing.add(name)
                continue
            todo += [(Requirement(r), want) for r in requires]
    return found, missing


def test_the_router_and_client_install_pulls_no_torch():
    project = _project()
    deps = project["dependencies"] + project["optional-dependencies"]["http"]
    found, missing = closure(deps)
    # huggingface-hub and starlette are reachable only through transformers' and
    # fastapi's own metadata: the walk follows installed requirements.
    assert {"grpcio", "protobuf", "transformers", "fastapi", "huggingface-hub",
            "starlette"} <= found
    assert not {n for n in found if HEAVY.match(n)}, sorted(found)
    assert not {n for n in missing if n in {"grpcio", "protobuf", "fastapi"}}


def test_the_check_sees_torch_where_it_is():
    project = _project()
    found, _ = closure(project["dependencies"]
                       + project["optional-dependencies"]["engine"])
    assert {"torch", "sympy", "networkx"} <= found  # torch's own requirements, followed
