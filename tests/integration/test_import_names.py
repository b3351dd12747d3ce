"""Python started at the repository's root imports every installed distribution's own
top-level names, never a folder of the checkout.

The code folders (kernels/, services/, router/, ...) have no `__init__.py`: each is a
portion of the namespace package `baton.<folder>`, and a namespace portion found on
sys.path never wins over a regular package or module of the same name found anywhere on
it (PEP 420). So `kernels/` cannot shadow Hugging Face's `kernels`, whatever puts the root
on sys.path: `python -c` or `python -m` run there (''/cwd first), pytest's rootdir, or an
image whose work dir holds the sources."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = {"baton", "baton_client"}

# Run as `python -c CHECK ROOT` from the root: prints one line per installed top-level
# name that resolves into the checkout (outside the venv), then the count of names checked.
CHECK = r"""
import importlib.util, sys
from importlib import metadata
from pathlib import Path

root, prefix = Path(sys.argv[1]).resolve(), Path(sys.prefix).resolve()
ours = set(sys.argv[2].split(","))
checked = 0
for name in sorted(metadata.packages_distributions()):
    if name in ours or not name.isidentifier():
        continue
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        continue  # a name its distribution does not make importable on its own
    if spec is None:
        continue
    checked += 1
    places = [spec.origin] if spec.origin else []
    places += list(spec.submodule_search_locations or [])
    for place in places:
        path = Path(place).resolve()
        if path.is_relative_to(root) and not path.is_relative_to(prefix):
            print(f"{name} -> {place}")
print(checked)
"""


def shadowed(cwd: Path) -> tuple[list[str], int]:
    """Names that resolve into `cwd`, for a Python started there, and how many were checked."""
    out = subprocess.run([sys.executable, "-c", CHECK, str(cwd), ",".join(OURS)], cwd=cwd,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    return out[:-1], int(out[-1])


def test_no_installed_name_resolves_into_the_checkout():
    bad, checked = shadowed(ROOT)
    assert not bad, bad
    assert checked > 50  # the venv's distributions were really walked
    # The name that broke installs: transformers 5.25+ imports Hugging Face's `kernels`.
    import importlib.util

    spec = importlib.util.find_spec("kernels")  # this process: pytest put the root first
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve().is_relative_to(Path(sys.prefix).resolve()), spec


def test_transformers_imports_its_kernels_from_the_root():
    # In this process, where pytest put the root on sys.path ahead of the venv, as
    # `python -c` run there does (the first test checks every name for a fresh one): a
    # fresh Python spent 4 to 12 s importing torch and transformers, which this process
    # has most often done already for other tests.
    venv = Path(sys.prefix).resolve()
    first = next(i for i, p in enumerate(sys.path) if Path(p).resolve().is_relative_to(venv))
    assert ROOT in [Path(p or ".").resolve() for p in sys.path[:first]], sys.path
    import transformers.modeling_utils  # noqa: F401 (it imports names from `kernels`)

    # The `kernels` transformers imported (an `import kernels` here would read, to
    # tests/unit/test_lock.py, as a dependency pyproject.toml does not declare).
    kernels = sys.modules["kernels"]
    assert not Path(kernels.__file__).resolve().is_relative_to(ROOT / "kernels")


def test_the_check_sees_a_folder_that_shadows(tmp_path):
    # A regular package named like an installed distribution, in the start folder, is
    # found: the check can fail. The same folder without __init__.py is not.
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    bad, _ = shadowed(tmp_path)
    assert {line.split(" -> ")[0] for line in bad} == {"kernels"}
    (tmp_path / "kernels" / "__init__.py").unlink()
    assert shadowed(tmp_path)[0] == []


def test_the_code_folders_are_namespace_portions():
    # An __init__.py would make a folder a regular package, which wins over an installed
    # distribution of the same name whenever the root is on sys.path.
    from tests.unit.test_layering import FOLDERS

    assert not [f for f in sorted(FOLDERS) if (ROOT / f / "__init__.py").exists()]
