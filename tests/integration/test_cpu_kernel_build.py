"""Building Baton's C++ CPU kernels (kernels/cpu_ops.py): once, outside the per-ISA
parametrization of tests/integration/test_cpu_kernels.py (these do not depend on it)."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest

from baton.kernels import cpu_ops


def test_the_cpu_kernels_build_where_there_is_a_compiler():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")
    assert cpu_ops.ops() is not None, cpu_ops.failure()


_LOAD = """\
import json, os, shutil, sys
from baton.kernels import cpu_ops
out = {"which": [shutil.which("c++"), shutil.which("ninja")]}
for case in sys.argv[1:]:
    os.environ["TORCH_EXTENSIONS_DIR"] = case
    cpu_ops._failed.clear()
    module = cpu_ops.ops(cpu_ops.isa)
    with open("/proc/self/maps") as f:
        mapped = case in f.read()
    out[os.path.basename(case)] = [module is not None, mapped, cpu_ops.failure(cpu_ops.isa)]
print(json.dumps(out))
"""
WHY = {"owner": "is owned by uid 12345", "library_owner": "is owned by uid 12345",
       "group_writable": "is writable by group or others (mode 775)",
       "link": "cannot be opened as a file", "other_bytes": "its build recorded"}


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """Build folders of the serving ISA, each under a TORCH_EXTENSIONS_DIR of its own, and
    what one process with no compiler (no c++ or ninja on its PATH) made of each: "built",
    cpu_ops's own build (the first test below), and a copy of a real build planted in each
    way the second test says. One process for all: each start imports torch, and only one
    of them may load (a library registers its ops once per process)."""
    import json
    import subprocess
    import sys

    from torch.utils import cpp_extension

    if cpu_ops.ops() is None:
        pytest.skip(f"no build of the CPU kernels here: {cpu_ops.failure()}")
    tmp = tmp_path_factory.mktemp("builds")
    real = cpu_ops.build_directory(cpu_ops.isa)
    so = f"baton_cpu_{cpu_ops.isa}.so"
    asked = []

    def compile_once_more(*, name, sources, build_directory, is_python_module, **kw):
        asked.append((name, sources, build_directory, is_python_module))
        shutil.copy2(real / so, os.path.join(build_directory, f"{name}.so"))

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", str(tmp / "built"))
        mp.setattr(cpu_ops, "_built", {})
        mp.setattr(cpu_ops, "_failed", {})
        mp.setattr(cpp_extension, "load", compile_once_more)
        served = cpu_ops.ops(cpu_ops.isa) is not None, cpu_ops.failure(cpu_ops.isa)
        built = cpu_ops.build_directory(cpu_ops.isa)
    root = os.geteuid() == 0
    cases = {}
    for case in WHY:
        if "owner" in case and not root:
            continue
        folder = tmp / case / real.name
        folder.mkdir(parents=True)
        shutil.copy2(real / so, folder / so)
        shutil.copy2(real / "built", folder / "built")
        cases[case] = folder
    if root:
        os.chown(cases["owner"], 12345, 12345)
        os.chown(cases["library_owner"] / so, 12345, 12345)
    cases["group_writable"].chmod(0o775)
    (cases["link"] / so).rename(cases["link"] / "real.so")
    (cases["link"] / so).symlink_to(cases["link"] / "real.so")
    with open(cases["other_bytes"] / so, "ab") as f:
        f.write(b"\0")
    bare = tmp / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    out = subprocess.run([sys.executable, "-c", _LOAD, *(str(tmp / c) for c in cases),
                          str(tmp / "built")],
                         env=dict(os.environ, PATH=str(bare)), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return SimpleNamespace(served=served, asked=asked, built=built,
                           got=json.loads(out.stdout), stderr=out.stderr)


def test_a_build_loads_as_it_is_where_there_is_no_compiler(loads):
    """What the worker image does: build once, then load in a process that has no
    compiler, from the same folder. The build is cpu_ops's own, into this test's folder
    (its checks, the sha256 it records), but torch's compile step hands over the library
    `make install` built from these very sources (their hash names its folder):
    compiling them again, half a minute, checks the compiler, not the load."""
    namespace = f"baton_cpu_{cpu_ops.isa}"
    assert loads.served == (True, None)
    assert loads.asked == [(namespace, [str(cpu_ops.SOURCE)], str(loads.built), False)]
    assert (loads.built / "built").read_text().startswith(f"{namespace} sha256=")
    assert loads.got["which"] == [None, None]  # the load really had neither
    assert loads.got["built"] == [True, True, None], loads.stderr[-2000:]


def test_a_copy_of_a_build_loads_only_where_every_check_holds(loads):
    """A real build, copied: planted where another user could have put it (a folder or
    library of another owner, one group or others may write, a link, other bytes than
    its build recorded), it is not loaded, each refusal said; a build that passes every
    check (the one the test above made, of the same library's bytes) is loaded from that
    very file, in the same process with no compiler to rebuild it."""
    got = dict(loads.got)
    del got["which"]
    assert got.pop("built") == [True, True, None], loads.stderr[-2000:]
    assert set(got) == {case for case in WHY if os.geteuid() == 0 or "owner" not in case}
    for case, (served, mapped, failure) in got.items():
        assert not served and not mapped and WHY[case] in failure, (case, loads.got)
        assert f"CPU kernels for {cpu_ops.isa} unavailable" in loads.stderr
