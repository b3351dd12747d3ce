"""Building Baton's C++ CPU kernels (kernels/cpu_ops.py): once, outside the per-ISA
parametrization of tests/integration/test_cpu_kernels.py (these do not depend on it)."""

from __future__ import annotations

import shutil

import pytest

from baton.kernels import cpu_ops


def test_the_cpu_kernels_build_where_there_is_a_compiler():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")
    assert cpu_ops.ops() is not None, cpu_ops.failure()


def test_a_build_loads_as_it_is_where_there_is_no_compiler(tmp_path):
    """What the worker image does: build once (here in a process with a compiler), then
    load in a process that has none (no c++ or ninja on its PATH), from the same folder."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    script = ("from baton.kernels import cpu_ops\n"
              "assert cpu_ops.ops('portable') is not None, cpu_ops.failure('portable')\n")
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler here to make the first build")
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    out = subprocess.run([sys.executable, "-c", script + "import shutil\n"
                          "print(shutil.which('c++'), shutil.which('ninja'))\n"],
                         env=dict(env, PATH=str(bare)), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "None None"  # the load really had neither
