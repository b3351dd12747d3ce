"""The lock (requirements/*.txt, written by `make lock`) against pyproject.toml and the code:
every package the code imports is declared, every declared requirement is pinned and
hashed at a version its range allows, and the images' locks pin what the tests ran."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "requirements"
CODE = ("services", "router", "prefill_worker", "decode_worker", "kv_transfer", "kernels",
        "cli", "tools", "baton_client", "protos", "scripts", "tests")
OURS = {"baton", "baton_client", "tests"}
# Imported, and rightly not declared: what a module imports only where it is present.
UNDECLARED = {
    "flash_attn": "GPU only: kernels/flash.py serves where a flash-attn build for the "
                  "machine's CUDA is installed, else Triton does",
    "vllm": "scripts/vllm_bench.py runs in vLLM's own venv (make vllm), never in Baton's",
    "llama_cpp": "scripts/llamacpp_bench.py runs in llama.cpp's own venv (make llamacpp), "
                 "never in Baton's",
}
# The markers the locks are resolved for (scripts/lock.py PLATFORM).
ENV = {"python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _declared() -> dict[str, list[Requirement]]:
    """Every requirement of the base install and of each extra, by distribution."""
    project = _project()
    reqs = [Requirement(r) for group in [project["dependencies"],
                                          *project["optional-dependencies"].values()]
            for r in group]
    out: dict[str, list[Requirement]] = {}
    for r in reqs:
        out.setdefault(canonicalize_name(r.name), []).append(r)
    return out


def pins(lock: str) -> dict[str, str]:
    """{distribution: version} of a lock file; each pin must carry a hash."""
    text = (LOCKS / lock).read_text()
    found = {}
    for block in re.split(r"\n(?=\S)", text):
        m = re.match(r"([A-Za-z0-9._-]+)==(\S+)", block)
        if m:
            assert "--hash=sha256:" in block, f"{lock}: {m[1]} is pinned without a hash"
            found[canonicalize_name(m[1])] = m[2]
    return found


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def third_party_imports(root: Path) -> dict[str, set[str]]:
    """{top-level import name: the files importing it}, outside the stdlib and Baton."""
    found: dict[str, set[str]] = {}
    for folder in CODE:
        for path in (root / folder).rglob("*.py"):
            for name in _imports(path) - OURS - set(sys.stdlib_module_names):
                if name in {"kernels", "services", "router", "cli", "tools"} and \
                        folder != "tests":
                    continue  # the checker's own fixtures name our folders bare
                found.setdefault(name, set()).add(path.relative_to(root).as_posix())
    return found


def undeclared(imports: dict[str, set[str]], declared: set[str]) -> list[str]:
    providers = metadata.packages_distributions()
    bad = []
    for name, files in sorted(imports.items()):
        if name in UNDECLARED:
            continue
        dists = {canonicalize_name(d) for d in providers.get(name, [])}
        if not dists & declared:
            bad.append(f"{name} ({', '.join(sorted(dists)) or 'not installed'}), "
                       f"imported by {sorted(files)[0]}")
    return bad


def test_every_imported_package_is_declared():
    bad = undeclared(third_party_imports(ROOT), set(_declared()))
    assert not bad, "imported but not declared in pyproject.toml:\n" + "\n".join(bad)


def test_the_check_sees_an_undeclared_import(tmp_path):
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "x.py").write_text("import grpc\nimport yaml\nimport pydantic\n")
    declared = set(_declared()) - {"pyyaml", "pydantic"}
    assert [b.split(" ")[0] for b in undeclared(third_party_imports(tmp_path), declared)] \
        == ["pydantic", "yaml"]


def test_every_declared_requirement_is_locked_in_its_range():
    locked = pins("dev.txt")
    for name, reqs in _declared().items():
        for req in reqs:
            if req.marker is not None and not req.marker.evaluate(ENV):
                continue
            assert name in locked, f"{req} is declared but not in requirements/dev.txt"
            assert req.specifier.contains(locked[name], prereleases=True), \
                f"requirements/dev.txt pins {name}=={locked[name]}, outside {req}"
    assert locked["torch"].endswith("+cpu")  # PyTorch's CPU build, never PyPI's CUDA one


def test_the_images_run_what_the_tests_ran():
    dev = pins("dev.txt")
    for lock, own in (("worker.txt", set()), ("router.txt", set()),
                      ("torch-cpu.txt", set()),
                      ("worker-gpu.txt", {"torch", "triton"})):
        other = {n: v for n, v in pins(lock).items()
                 if n not in own and not n.startswith(("nvidia-", "cuda-"))}
        drift = {n: (v, dev.get(n)) for n, v in other.items() if dev.get(n) != v}
        assert not drift, f"{lock} pins other versions than dev.txt: {drift}"
    assert "torch" not in pins("router.txt")
