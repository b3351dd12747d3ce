"""The structure, measured from the imports (docs/architecture.md): which folder may import
which, everything imported under the one `baton.` namespace, no import cycle, no
hand-written file over 400 lines, and the parts that must load without torch do."""

from __future__ import annotations

import ast
import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The repository's top-level folders that install as baton.<folder> (pyproject.toml).
FOLDERS = {"services", "router", "prefill_worker", "decode_worker", "kv_transfer", "kernels",
           "cli", "tools"}
OURS = FOLDERS | {"protos", "baton", "baton_client"}
CONTRACT = {"kv_transfer.base", "kv_transfer.blocks"}  # what services may use of kv_transfer
STUBS = "baton.v1"  # the public API's generated stubs (protos/baton/v1)
INTERNAL = "baton.worker.v1"  # the workers' internal API's (protos/baton/worker/v1)
# Floors, bottom up: kernels; services/common (torch- and gRPC-free types); the engine and
# services/lora beside it (and the KV transfer contract); services/rpc (the gRPC shell);
# services/worker, with services/lora/calls.py; the workers and the router; cli and tools
# on top.
# Folder (or sub-package) -> project packages (dotted prefixes, `baton.` left out) it may
# import, besides itself. The most specific folder applies.
ALLOWED = {
    "kernels": set(),
    "protos": {STUBS},  # generated stubs import each other as baton.v1.*
    "kv_transfer": {STUBS, "kernels.kv_layout"},  # the cache layout, defined once
    "services": {"kernels", STUBS, INTERNAL, "services", *CONTRACT},
    "services/common": set(),
    "services/engine": {"kernels", "services.common", "services.lora", *CONTRACT},
    # LoRA on the worker's side: the engine's floor (the engine holds its adapters; they
    # are checked against its ModelConfig), but for the worker's calls.
    "services/lora": {"kernels", "services.common", "services.engine.model_config"},
    "services/lora/calls.py": {STUBS, INTERNAL, "services.lora", "services.rpc",
                               "services.worker"},
    "services/rpc": {STUBS, "services.common", "kv_transfer.base"},
    "router": {STUBS, INTERNAL, "services.common", "services.lora.names",
               "services.lora.paths", "services.rpc"},
    "prefill_worker": {"services", "kv_transfer", "kernels", STUBS, INTERNAL},
    "decode_worker": {"services", "kv_transfer", "kernels", STUBS, INTERNAL},
    "cli": OURS,
    "tools": OURS,
    "baton_client": {STUBS},  # the public client: the stubs and nothing else
}
FORBIDDEN_THIRD_PARTY = {"router": {"torch"}, "services/common": {"torch", "grpc"},
                         "services/lora/names.py": {"torch", "grpc"},
                         "services/lora/paths.py": {"torch", "grpc"},
                         "services/rpc": {"torch"}, "kv_transfer/base.py": {"torch"},
                         "kv_transfer/head_map.py": {"torch"},
                         "kernels/kv_layout.py": {"torch"},
                         "services/engine/kv_offload": {"torch"},
                         "services/engine/private_files.py": {"torch"},
                         "baton_client": {"torch", "transformers", "numpy"}}
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
MAX_LINES = 400


def _local(name: str) -> str:
    """`baton.services.engine.x` -> `services.engine.x`: the folder it lives in."""
    parts = name.split(".")
    return ".".join(parts[1:]) if parts[0] == "baton" and parts[1:2] and parts[1] in FOLDERS \
        else name


def _package(rel: str) -> str:
    """The package a file of the checkout is in, installed: services/engine/x.py (and
    services/engine/__init__.py) -> baton.services.engine; protos/baton/v1/x.py ->
    baton.v1."""
    parts = rel.removesuffix(".py").split("/")
    parts = parts[1:] if parts[0] == "protos" else parts if parts[0] not in FOLDERS \
        else ["baton", *parts]
    return ".".join(parts[:-1])


def _imports(path: Path, package: str) -> list[str]:
    """Every module `path` (in `package`) imports, by absolute name: import statements
    anywhere (lazy ones included; relative ones resolved), and importlib.import_module /
    __import__ calls with a constant name."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            # `from ..x import y` in a.b.c: level 2 goes up to a.b, then down to a.b.x
            base = package.split(".")[:len(package.split(".")) - node.level + 1] \
                if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.append(module)
            names += [f"{module}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "__import__"))):
            names.append(node.args[0].value)
    return names


def _rule(rel: str) -> tuple[str, set[str]] | None:
    best = max((k for k in ALLOWED if rel == k or rel.startswith(k + "/")), key=len,
               default=None)
    return (best, ALLOWED[best]) if best else None


def _python_files(root: Path):
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in OURS and not rel.endswith(GENERATED):
            yield rel, path


def _violations(root: Path) -> list[str]:
    bad = []
    for rel, path in _python_files(root):
        rule = _rule(rel)
        if rule is None:
            continue
        folder, allowed = rule
        forbidden = set().union(*(v for k, v in FORBIDDEN_THIRD_PARTY.items()
                                  if rel == k or rel.startswith(k + "/")))
        for raw in _imports(path, _package(rel)):
            if raw.split(".")[0] in FOLDERS:
                bad.append(f"{rel} imports {raw} outside the baton namespace")
            name = _local(raw)
            top = name.split(".")[0]
            if name == "baton":
                continue
            if top in forbidden:
                bad.append(f"{rel} imports {raw}")
            own = folder.replace("/", ".")
            if top not in OURS or name == own or name.startswith(own + "."):
                continue
            if not any(name == a or name.startswith(a + ".") for a in allowed):
                bad.append(f"{rel} imports {raw}")
    return sorted(set(bad))


def _module_graph(root: Path) -> dict[str, set[str]]:
    mods = {}
    for rel, path in _python_files(root):
        name = rel[:-3].replace("/", ".").removesuffix(".__init__")
        if name.startswith("protos."):
            name = name[len("protos."):]
        mods[name] = path, _package(rel)
    graph = {}
    for name, (path, package) in mods.items():
        graph[name] = {n for n in map(_local, _imports(path, package))
                       if n in mods and n != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_folders_import_only_what_design_allows():
    bad = _violations(ROOT)
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_no_import_cycle():
    cycles = _cycles(_module_graph(ROOT))
    assert not cycles, f"import cycles: {cycles}"


def test_no_hand_written_file_over_400_lines():
    long = [f"{rel}: {n}" for rel, path in _python_files(ROOT)
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    tests = [f"{p.relative_to(ROOT)}: {n}" for folder in ("tests", "scripts")
             for p in (ROOT / folder).rglob("*.py")
             if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long + tests, long + tests




def test_the_checks_see_violations(tmp_path):
    # Guard against checks that cannot fail: a router importing torch and the engine, a
    # decode worker importing the prefill worker, the engine importing a worker through
    # import_module, and a cycle, are all caught; allowed imports pass.
    for folder, text in {
        "router/x.py": "import torch\nfrom baton.services.engine import LLM\n"
                       "from baton.services.rpc import a\nimport services.common.b\n",
        "decode_worker/y.py": "import baton.prefill_worker.z\nimport baton.kv_transfer\n",
        "services/engine/e.py": "import importlib\n"
                                "importlib.import_module('baton.services.worker.w')\n"
                                "from baton.kv_transfer.base import KVHandle\n",
        "kernels/a.py": "import baton.kernels.b\n",
        "kernels/b.py": "import baton.kernels.a\n",
        "baton_client/c.py": "from baton.v1 import generation_pb2\n"
                             "from baton.worker.v1 import worker_pb2\n",
        # Relative imports, resolved: a folder's own modules import each other so.
        "services/common/c.py": "from ..engine import llm\nfrom . import d\n",
        "services/common/d.py": "from .c import x\n",
    }.items():
        (tmp_path / folder).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / folder).write_text(text)
    assert _violations(tmp_path) == [
        "baton_client/c.py imports baton.worker.v1",
        "baton_client/c.py imports baton.worker.v1.worker_pb2",
        "decode_worker/y.py imports baton.prefill_worker.z",
        "router/x.py imports baton.services.engine",
        "router/x.py imports baton.services.engine.LLM",
        "router/x.py imports services.common.b outside the baton namespace",
        "router/x.py imports torch",
        "services/common/c.py imports baton.services.engine",
        "services/common/c.py imports baton.services.engine.llm",
        "services/engine/e.py imports baton.services.worker.w",
    ]
    assert _cycles(_module_graph(tmp_path)) == [["kernels.a", "kernels.b"],
                                                ["services.common.c", "services.common.d"]]




def test_pyproject_ships_every_package_under_baton():
    # Every package of the checkout is installed, and under baton.* only (baton_client, the
    # public client, keeps its own name).
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    # A folder is a package (a namespace portion, or regular where it has __init__.py)
    # where it holds Python modules, or folders that do.
    stubs = ROOT / "protos"
    here = {"baton_client"} | {  # baton, and the stubs' packages (the links not followed)
        Path(top).relative_to(stubs).as_posix().replace("/", ".")
        for top, _, _ in os.walk(stubs / "baton")
        if Path(top).name != "__pycache__" and any(Path(top).glob("*.py"))} | {
        "baton." + d.relative_to(ROOT).as_posix().replace("/", ".")
        for folder in FOLDERS for d in [ROOT / folder, *(ROOT / folder).rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and any(d.rglob("*.py"))}
    assert set(tool["packages"]) == here
    assert tool["package-dir"] == {"baton": "protos/baton",
                                   **{f"baton.{f}": f for f in FOLDERS}}


def _documented_rules() -> dict[str, set[str]]:
    """docs/architecture.md's table of which folder may import which, as ALLOWED spells it."""
    rules = {}
    section = (ROOT / "docs" / "architecture.md").read_text().split(
        "## Which folder may import which")[1].split("\n## ")[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        may = cells[1]
        rules[cells[0].strip("`")] = (OURS if may == "anything of Baton's" else set()
                                      if may == "nothing" else
                                      {m.strip().strip("`") for m in may.split(",")})
    return rules


def test_the_architecture_page_states_the_rules_this_test_enforces():
    assert _documented_rules() == ALLOWED
