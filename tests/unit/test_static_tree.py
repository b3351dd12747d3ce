"""The package as tools that read files see it (docs/architecture.md, "How the code is put
together"): protos/baton links every code folder, and the type checker of `make lint`
reads every module of the package, each once."""

from __future__ import annotations

import tomllib
from pathlib import Path

from tests.unit.test_layering import FOLDERS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "protos" / "baton"


def test_protos_baton_links_every_code_folder_and_nothing_else():
    links = {p.name: p for p in PACKAGE.iterdir() if p.is_symlink()}
    assert set(links) == FOLDERS
    for name, link in links.items():
        # Relative, so that a clone anywhere (or a COPY into an image) keeps them whole.
        assert link.readlink() == Path("..", "..", name)
        assert link.resolve() == (ROOT / name).resolve()


def test_the_type_checker_reads_every_module_once():
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pyright"]["include"]
    # The links are not listed (each file would be read twice): the folders are, and
    # protos/baton's own files and generated packages.
    stubs = {f"protos/baton/{p.name}" for p in PACKAGE.iterdir()
             if p.is_dir() and not p.is_symlink() and p.name != "__pycache__"}
    assert set(include) == FOLDERS | {"baton_client", "protos/baton/__init__.py"} | stubs
