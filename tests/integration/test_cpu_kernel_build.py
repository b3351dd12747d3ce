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


_PLANTED = """\
import json, os, sys
from baton.kernels import cpu_ops
out = {}
for case in sys.argv[1:]:
    os.environ["TORCH_EXTENSIONS_DIR"] = case
    cpu_ops._failed.clear()
    module = cpu_ops.ops(cpu_ops.isa)
    with open("/proc/self/maps") as f:
        mapped = case in f.read()
    out[os.path.basename(case)] = [module is not None, mapped, cpu_ops.failure(cpu_ops.isa)]
print(json.dumps(out))
"""


def test_a_copy_of_a_build_loads_only_where_every_check_holds(tmp_path):
    """A real build, copied: planted where another user could have put it (a folder or
    library of another owner, one group or others may write, a link, other bytes than
    its build recorded), it is not loaded, each refusal said; a copy that passes every
    check is loaded from that very file, in a process with no compiler to rebuild it."""
    import json
    import os
    import subprocess
    import sys

    if cpu_ops.ops() is None:
        pytest.skip(f"no build of the CPU kernels here: {cpu_ops.failure()}")
    built = cpu_ops.build_directory(cpu_ops.isa)
    so = f"baton_cpu_{cpu_ops.isa}.so"
    root = os.geteuid() == 0
    cases = {}
    for case in ("owner", "library_owner", "group_writable", "link", "other_bytes", "good"):
        if "owner" in case and not root:
            continue
        folder = tmp_path / case / built.name
        folder.mkdir(parents=True)
        shutil.copy2(built / so, folder / so)
        shutil.copy2(built / "built", folder / "built")
        cases[case] = folder
    if root:
        os.chown(cases["owner"], 12345, 12345)
        os.chown(cases["library_owner"] / so, 12345, 12345)
    cases["group_writable"].chmod(0o775)
    (cases["link"] / so).rename(cases["link"] / "real.so")
    (cases["link"] / so).symlink_to(cases["link"] / "real.so")
    with open(cases["other_bytes"] / so, "ab") as f:
        f.write(b"\0")
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    out = subprocess.run([sys.executable, "-c", _PLANTED,
                          *(str(tmp_path / case) for case in cases)],
                         env=dict(os.environ, PATH=str(bare)), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    why = {"owner": "is owned by uid 12345", "library_owner": "is owned by uid 12345",
           "group_writable": "is writable by group or others (mode 775)",
           "link": "cannot be opened as a file", "other_bytes": "its build recorded"}
    for case, (served, mapped, failure) in got.items():
        if case == "good":
            assert served and mapped and failure is None, got
        else:
            assert not served and not mapped and why[case] in failure, (case, got)
            assert f"CPU kernels for {cpu_ops.isa} unavailable" in out.stderr
