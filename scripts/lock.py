"""Writes the lock files (requirements/*.txt) from pyproject.toml with uv: `make lock`.

Every lock is for CPython 3.11 on x86-64 Linux, hashed, with every package pinned:

    torch-cpu.txt   torch alone, PyTorch's CPU build: installed first, so nothing else can
                    bring a CUDA build
    dev.txt         the development and test venv (`make install`): every extra
    worker.txt      the CPU worker image: the engine and NIXL (a subset of dev.txt's pins)
    router.txt      the torch-free router image: the base install and the HTTP API (idem)
    worker-gpu.txt  the GPU worker image: PyPI's torch (its CUDA build) and the triton it
                    pins; the rest at dev.txt's pins

The CPU build of torch is on PyTorch's CPU index, not on PyPI. uv reads no pip
configuration, so this script hands it the sources explicitly: PyTorch's CPU index when it
answers, and the wheel folders pip is configured with (`find-links`), where a machine
without that index keeps the file. The file is the same either way, and so is its hash.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "requirements"
PLATFORM = ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28"]
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# The CUDA image's own pins: everything else in it is held at dev.txt's.
GPU_OWN = {"torch", "triton"}


def pip_find_links() -> list[str]:
    """The wheel folders pip is configured with (its config files and PIP_FIND_LINKS)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True).stdout
    found = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            found += [v for v in value.strip().strip("'\"").split() if v not in found]
    return found


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/torch/", timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def uv() -> str:
    found = shutil.which("uv", path=f"{Path(sys.executable).parent}{os.pathsep}"
                         f"{os.environ.get('PATH', '')}")
    if found is None:
        sys.exit("uv is not installed: `make install` puts it in the venv (the dev extra)")
    return found


def compile_lock(name: str, inputs: list[str], extras: list[str], sources: list[str],
                 constraints: list[Path]) -> None:
    cmd = [uv(), "pip", "compile", "--quiet", "--generate-hashes", *PLATFORM,
           "--custom-compile-command", "make lock", *inputs, *sources,
           "-o", str(OUT / name)]
    cmd += [a for e in extras for a in ("--extra", e)]
    cmd += [a for c in constraints for a in ("-c", str(c.relative_to(ROOT)))]
    subprocess.run(cmd, cwd=ROOT, check=True)


def without(lock: Path, names: set[str], dest: Path) -> Path:
    """A copy of `lock` as plain pins (constraints), leaving out `names`."""
    pins = re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", lock.read_text(), re.M)
    dest.write_text("".join(f"{n}=={v}\n" for n, v in pins if n.lower() not in names))
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-index", default=TORCH_INDEX,
                        help="PyTorch's CPU index (used when it answers)")
    args = parser.parse_args()
    cpu = [a for d in pip_find_links() for a in ("--find-links", d)]
    if answers(args.torch_index):
        cpu += ["--extra-index-url", args.torch_index]
    if not cpu:
        sys.exit(f"no source of the CPU torch: {args.torch_index} does not answer and pip "
                 "has no find-links folder")
    OUT.mkdir(exist_ok=True)
    torch_in, build_in = OUT / "torch-cpu.in", OUT / "build.in"
    compile_lock("dev.txt", ["pyproject.toml", str(build_in.relative_to(ROOT))],
                 ["engine", "nixl", "http", "test", "dev"], cpu, [torch_in])
    dev = OUT / "dev.txt"
    # torch alone, as dev.txt pins and hashes it (installed before the rest)
    block = re.search(r"^torch==.*?(?=^\S)", dev.read_text(), re.M | re.S)
    (OUT / "torch-cpu.txt").write_text("# torch-cpu.txt: torch as dev.txt pins it, installed "
                                       "first (written by `make lock`)\n" + block.group(0))
    compile_lock("worker.txt", ["pyproject.toml", str(build_in.relative_to(ROOT))],
                 ["engine", "nixl"], cpu, [torch_in, dev])
    compile_lock("router.txt", ["pyproject.toml", str(build_in.relative_to(ROOT))], ["http"],
                 [], [dev])
    # The GPU lock is held at dev.txt's pins but for torch and triton (a git-ignored file:
    # the lock names its constraint files by their paths in the checkout).
    held = ROOT / ".cache" / "lock" / "dev-pins-but-torch.txt"
    held.parent.mkdir(parents=True, exist_ok=True)
    compile_lock("worker-gpu.txt", ["pyproject.toml", str(build_in.relative_to(ROOT))],
                 ["engine", "nixl"], [], [OUT / "torch-gpu.in", without(dev, GPU_OWN, held)])


if __name__ == "__main__":
    main()
