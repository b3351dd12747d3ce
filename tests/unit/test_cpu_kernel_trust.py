"""The CPU kernels' library is loaded only from where no one else could have put it
(kernels/cpu_ops.py: check_folders, open_library): a build folder or library another
user owns, that group or others may write, a library reached through a link, or one
whose bytes are not those its build recorded is never loaded; the warning names the path
and why, and torch's ops serve, as where a build fails. On crafted files, without a
compiler (tests/integration/test_cpu_kernel_build.py loads a real copy)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os

import pytest

from baton.kernels import cpu_ops

ISA = "portable"
NAMESPACE = f"baton_cpu_{ISA}"
BYTES = b"\x7fELF not really a library"
OTHER_UID = 12345
LOADED: list[str] = []  # what dlopen was asked for, in the test running


def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")


def _plant(root, sha256: str | None = None):
    """A build of ISA in TORCH_EXTENSIONS_DIR `root`, as a finished build leaves it: the
    library and the marker naming its sha256 (`sha256`, to record another)."""
    directory = root / cpu_ops.build_directory(ISA).name
    directory.mkdir(mode=0o755)
    so = directory / f"{NAMESPACE}.so"
    so.write_bytes(BYTES)
    so.chmod(0o755)
    digest = sha256 or hashlib.sha256(BYTES).hexdigest()
    (directory / "built").write_text(f"{NAMESPACE} sha256={digest}\n")
    return directory, so


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A TORCH_EXTENSIONS_DIR of this test's own; nothing is really loaded or built."""
    tmp_path.chmod(0o755)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_ops, "_built", {})
    monkeypatch.setattr(cpu_ops, "_failed", {})
    LOADED.clear()
    monkeypatch.setattr(ctypes, "CDLL", lambda path, *a, **k: LOADED.append(path))

    def no_build(**kw):
        pytest.fail(f"a build was started in {kw.get('build_directory')}")

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", no_build)
    return tmp_path


def _ops():
    """cpu_ops.ops(ISA) with the kernels on (the unit rule turns them off: no compiler
    may start here, and none does: `root` fails a build)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATON_CPU_KERNELS", "1")
        return cpu_ops.ops(ISA), cpu_ops.failure(ISA)


def _refused(root, caplog, why: str, path) -> None:
    with caplog.at_level(logging.WARNING, logger=cpu_ops.log.name):
        module, failure = _ops()
    assert module is None
    assert LOADED == [], "a planted library was loaded"
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert f"{path} {why}" in warning, warning
    assert failure is not None and why in failure


def test_a_build_folder_another_user_owns_is_not_loaded(root, caplog):
    _as_root()
    directory, _ = _plant(root)
    os.chown(directory, OTHER_UID, OTHER_UID)
    _refused(root, caplog, f"is owned by uid {OTHER_UID}", directory)


def test_a_library_another_user_owns_is_not_loaded(root, caplog):
    _as_root()
    _, so = _plant(root)
    os.chown(so, OTHER_UID, OTHER_UID)
    _refused(root, caplog, f"is owned by uid {OTHER_UID}", so)


def test_a_folder_above_another_user_owns_is_not_trusted(root, caplog):
    _as_root()
    _plant(root)
    os.chown(root, OTHER_UID, OTHER_UID)  # it could move our folder away and plant its own
    _refused(root, caplog, f"is owned by uid {OTHER_UID}", root)


@pytest.mark.parametrize("mode", [0o775, 0o757])
def test_a_build_folder_group_or_others_may_write_is_not_loaded(root, caplog, mode):
    directory, _ = _plant(root)
    directory.chmod(mode)
    _refused(root, caplog, f"is writable by group or others (mode {mode:o})", directory)


@pytest.mark.parametrize("mode", [0o775, 0o757])
def test_a_library_group_or_others_may_write_is_not_loaded(root, caplog, mode):
    _, so = _plant(root)
    so.chmod(mode)
    _refused(root, caplog, f"is writable by group or others (mode {mode:o})", so)


def test_a_folder_above_that_others_may_write_is_trusted_only_when_sticky(root, caplog):
    _plant(root)
    root.chmod(0o1777)  # as /tmp: no one else may move what is ours in it
    assert cpu_ops.check_folders(cpu_ops.build_directory(ISA)).parent == root
    root.chmod(0o777)
    _refused(root, caplog, "is writable by group or others (mode 777)", root)


def test_a_library_reached_through_a_link_is_not_loaded(root, caplog):
    _, so = _plant(root)
    real = root / "elsewhere.so"
    so.rename(real)
    so.symlink_to(real)  # the link's target hashes as recorded: still refused
    _refused(root, caplog, "cannot be opened as a file", so)


def test_a_library_whose_bytes_are_not_the_recorded_ones_is_not_loaded(root, caplog):
    _, so = _plant(root, sha256="0" * 64)
    _refused(root, caplog, f"has sha256 {hashlib.sha256(BYTES).hexdigest()}, its build "
             f"recorded {'0' * 64}", so)


def test_a_library_that_passes_every_check_is_loaded_through_its_descriptor(
        root, monkeypatch):
    import types

    import torch

    _plant(root)
    # The planted bytes register nothing (CDLL is faked): the ops it would register, as
    # a real library does, so that this test passes alone, not only after one loaded.
    monkeypatch.setattr(torch.ops, NAMESPACE, types.SimpleNamespace(rms_norm=object()),
                        raising=False)
    assert _ops()[0] is not None
    (path,) = LOADED
    assert path.startswith("/proc/self/fd/")  # the very file hashed, not a name again


def test_a_build_folder_with_no_recorded_hash_is_built_again_not_loaded(root, caplog):
    """A marker from before the hash (or none): the folder is ours, so it is built there
    again, and the build records the hash; nothing is loaded unchecked."""
    directory, _ = _plant(root)
    (directory / "built").write_text(f"{NAMESPACE}\n")
    with caplog.at_level(logging.WARNING, logger=cpu_ops.log.name):
        with pytest.raises(pytest.fail.Exception, match="a build was started"):
            _ops()
    assert LOADED == []
