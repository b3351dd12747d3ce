"""Baton's CPU kernels (kernels/cpu/): one C++ source, built once per ISA and picked at run
time from the CPU's flags.

    kernel        what it replaces
    rms_norm      the residual add and RMSNorm: one pass over the row, not three ops
    silu_and_mul  SiLU of the gate times the up projection
    decode        decode attention read in place through the block tables (attention.h)
    prefill       every prefill chunk of a step in one call, flash-style (prefill.h)
    rope_and_cache  RoPE on q and k, then k and v into the paged cache (rope_cache.h)
    qmm           x @ W^T with W kept quantized: int8, GGUF q8_0 / q4_0 / q4_1 (qmm.h)

A build for one ISA is compiled with that ISA's flags only: never -march=native (a cached
build must load on any CPU with the same flags), never -ffast-math (softmax keeps its
NaN and infinity rules). Each build registers its ops under torch.ops.baton_cpu_<isa>.
Builds use torch's C++ extension builder, cached under TORCH_EXTENSIONS_DIR in a folder
named by the sources and flags (build_directory); `make install` builds the native one,
and a build made once is loaded without a compiler. Where a build fails (no compiler),
`ops()` returns None, says why once, and torch's ops serve.

A library is native code run at start, so it is loaded only from where no one else could
have put it: the build folder and every folder above it owned by this user or root and
writable by no one else (check_folders), and only the bytes its build recorded (the
marker holds their sha256), read through one descriptor that is then loaded itself
(open_library). A folder or library that fails a check is not loaded: torch's ops serve,
as where a build fails, and the warning names the path and why.

A kernel serves only on the ISAs where it measured faster than the torch ops it replaces
(FASTER, from `python -m baton.tools.bench.kernels`). BATON_CPU_ISA=<name> picks another
ISA the CPU has (tests run every one); BATON_CPU_KERNELS=0 turns them all off.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "ops.cpp"

# Best first: (CPU flags it needs, as /proc/cpuinfo names them; compiler flags).
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c")
ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # AVX-512 with its bf16 pair products (vdpbf16ps: prefill attention's bf16 path) and
    # VNNI's byte products (vpdpbusd: quantized weights, qmm.h); every CPU with the first
    # has the second.
    "avx512_bf16": ((*_AVX512, "avx512_bf16", "avx512_vnni"),
                    (*(f"-m{f}" for f in _AVX512), "-mavx512bf16", "-mavx512vnni")),
    "avx512": (_AVX512, tuple(f"-m{f}" for f in _AVX512)),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    "portable": ((), ()),
}

# Where each kernel measured faster than torch's ops, bf16 at the default model's shapes
# (`python -m baton.tools.bench.kernels`; docs/benchmarks.md, issue 40). Measured on a CPU
# with AVX-512, where torch's own ops run their AVX-512 code: the avx2 and portable rows
# compare against that, so they are conservative for a CPU that has only AVX2.
FASTER: dict[str, frozenset[str]] = {
    "rms_norm": frozenset({"avx512_bf16", "avx512"}),  # avx2: 0.8-1.3x from run to run
    "silu_and_mul": frozenset({"avx512_bf16", "avx512"}),
    "decode": frozenset({"avx512_bf16", "avx512", "avx2"}),
    # bf16 pair products only: the fp32 tiles of other ISAs were at best even with SDPA.
    "prefill": frozenset({"avx512_bf16"}),
    "rope_and_cache": frozenset({"avx512_bf16", "avx512", "avx2"}),  # portable: 1.06x
    # Quantized weights (kernels/quant.py): against dequantizing for each call, always.
    "qmm": frozenset(ISAS),
}
# The prefill kernel's head sizes (a multiple of every ISA's vector width, 16 floats), and
# the dtypes it serves: bf16, measured; fp32 and fp16 run it in tests (every_kernel).
PREFILL_HEAD_DIMS = (16, 32, 64, 128, 256)
PREFILL_DTYPES = frozenset({torch.bfloat16})


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return set()


def supported() -> list[str]:
    """The ISAs this CPU runs, best first (portable always)."""
    flags = cpu_flags()
    return [name for name, (need, _) in ISAS.items() if set(need) <= flags]


def _initial() -> str:
    asked = os.environ.get("BATON_CPU_ISA")
    if asked and asked not in supported():
        raise ValueError(f"BATON_CPU_ISA={asked!r}: this CPU runs {supported()}")
    return asked or supported()[0]


isa = _initial()  # the ISA whose build serves now
_built: dict[str, Any] = {}
_failed: dict[str, str] = {}


def set_isa(name: str) -> None:
    global isa
    if name not in supported():
        raise ValueError(f"ISA {name!r}: this CPU runs {supported()}")
    isa = name


@contextlib.contextmanager
def using(name: str, every_kernel: bool = False) -> Iterator[None]:
    """Serve from `name`'s build inside the block; with every_kernel, every kernel serves
    there, for every dtype, faster or not (tests run each kernel through each ISA)."""
    global FASTER, PREFILL_DTYPES
    old = isa, FASTER, PREFILL_DTYPES
    set_isa(name)
    if every_kernel:
        FASTER = {kernel: frozenset(ISAS) for kernel in FASTER}
        PREFILL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
    try:
        yield
    finally:
        set_isa(old[0])
        FASTER, PREFILL_DTYPES = old[1], old[2]


def _flags(name: str) -> list[str]:
    return ["-O3", "-fopenmp", "-fno-math-errno", f"-DBATON_CPU_NS=baton_cpu_{name}",
            *ISAS[name][1]]


def build_directory(name: str) -> Path:
    """Where `name`'s build lives: named by a hash of every file in kernels/cpu/, the flags,
    torch's and Python's versions. So a changed header rebuilds as a changed source does,
    and a build made once (by `make install`, in the image, by another checkout of the same
    sources) is loaded as it is: no compiler, no ninja, no rebuild for another path."""
    h = hashlib.sha256()
    for path in sorted(SOURCE.parent.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    h.update(repr((_flags(name), torch.__version__, sys.version_info[:2])).encode())
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"baton_cpu_{name}-{h.hexdigest()[:16]}"


class Untrusted(Exception):
    """A build folder or library that someone other than this user or root could have
    written: never loaded."""


def _owned(st: os.stat_result, path: object, sticky: bool = False) -> None:
    """Untrusted unless owned by this user or root and writable by no one else (or, where
    `sticky` may be, writable by all with the sticky bit, as /tmp: then only the owner of
    an entry may move or remove it)."""
    if st.st_uid not in (os.geteuid(), 0):
        raise Untrusted(f"{path} is owned by uid {st.st_uid}, not by this user or root")
    if st.st_mode & 0o022 and not (sticky and st.st_mode & stat.S_ISVTX):
        raise Untrusted(f"{path} is writable by group or others (mode "
                        f"{stat.S_IMODE(st.st_mode):o})")


def check_folders(directory: Path) -> Path:
    """`directory`, links resolved, once it and every folder above it pass `_owned` (those
    above may be sticky); Untrusted otherwise. Folders not made yet are skipped: the
    build makes them, as this user."""
    real = Path(os.path.realpath(directory))
    for folder in (real, *real.parents):
        try:
            st = os.stat(folder)
        except FileNotFoundError:
            continue
        _owned(st, folder, sticky=folder != real)
    return real


def _recorded(directory: Path, namespace: str) -> str | None:
    """The sha256 the build recorded in `directory`'s marker; None where no build did."""
    try:
        fd = os.open(directory / "built", os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:  # the folder too, maybe
        return None
    with os.fdopen(fd) as f:
        words = f.read(200).split()
    if len(words) == 2 and words[0] == namespace and words[1].startswith("sha256="):
        return words[1].removeprefix("sha256=")
    return None  # none, or one from before the hash was recorded: built again


def open_library(directory: Path, namespace: str, sha256: str | None) -> tuple[int, str]:
    """A descriptor of `namespace`'s library in `directory` (checked: check_folders) and
    the sha256 of its bytes, once the file is no link, is a regular file owned by this
    user or root and writable by no one else, and (`sha256` given) hashes to it; Untrusted
    otherwise. The caller loads that very file (`/proc/self/fd/<n>`)."""
    path = directory / f"{namespace}.so"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:  # ELOOP: a symbolic link
        raise Untrusted(f"{path} cannot be opened as a file ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"{path} is not a regular file")
        _owned(st, path)
        with os.fdopen(fd, "rb", closefd=False) as f:
            got = hashlib.file_digest(f, "sha256").hexdigest()
        if sha256 is not None and got != sha256:
            raise Untrusted(f"{path} has sha256 {got}, its build recorded {sha256}")
    except BaseException:
        os.close(fd)
        raise
    return fd, got


def _build(directory: Path, name: str, namespace: str) -> None:
    """Build `name` into `directory` (torch's builder loads the library it made: no one
    else can write there), then record the sha256 of its bytes in the marker."""
    from torch.utils.cpp_extension import load as build

    old = os.umask(0o022)  # every folder and file it makes: writable by this user alone
    os.umask(old | 0o022)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        check_folders(directory)
        # Not a Python module: the library registers its ops with torch's dispatcher.
        # torch's builder locks the directory: processes building at once wait.
        build(name=namespace, sources=[str(SOURCE)], is_python_module=False, verbose=False,
              build_directory=str(directory), extra_include_paths=[str(SOURCE.parent)],
              extra_cflags=_flags(name), extra_ldflags=["-fopenmp"])
        fd, sha256 = open_library(directory, namespace, None)
        os.close(fd)
        part = directory / f"built.{os.getpid()}"
        part.write_text(f"{namespace} sha256={sha256}\n")
        part.replace(directory / "built")  # whole, or not there
    finally:
        os.umask(old)


_LIBRARY_FDS: list[int] = []


def _load(name: str, namespace: str) -> None:
    """`name`'s library, built first where no build recorded one; Untrusted where a
    folder or the library fails a check."""
    directory = check_folders(build_directory(name))
    sha256 = _recorded(directory, namespace)
    if sha256 is None:
        _build(directory, name, namespace)
        return
    fd, _ = open_library(directory, namespace, sha256)
    try:
        # torch.ops.load_library would resolve this link and open the file again by
        # name; dlopen of the link opens the very file hashed (what load_library does).
        ctypes.CDLL(f"/proc/self/fd/{fd}")
    except BaseException:
        os.close(fd)
        raise
    # Kept open for the process's life: dlopen knows a loaded library by its name, so a
    # later ISA's library opened on a reused descriptor number would be taken for this one.
    _LIBRARY_FDS.append(fd)
    if not hasattr(getattr(torch.ops, namespace), "rms_norm"):
        raise Untrusted(f"{directory}: its library registered no {namespace} ops")


def ops(name: str | None = None) -> Any:
    """torch.ops.baton_cpu_<isa> for `name` (default: the serving ISA), built at first use;
    None, with the reason logged once, where it cannot build or kernels are off."""
    name = name or isa
    if name in _built:
        return _built[name]
    if name in _failed:
        return None
    if os.environ.get("BATON_CPU_KERNELS", "1") == "0":
        return None  # not remembered: a test may turn kernels off for a while
    try:
        namespace = f"baton_cpu_{name}"
        _load(name, namespace)
        _built[name] = getattr(torch.ops, namespace)
    except Exception as e:  # no compiler, no headers, a check failed: torch's ops serve
        _failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning("CPU kernels for %s unavailable, using torch's ops (%s)", name,
                    _failed[name])
        return None
    return _built[name]


def failure(name: str | None = None) -> str | None:
    """Why `name`'s build (default: the serving ISA's) is unavailable, if it is."""
    name = name or isa
    if os.environ.get("BATON_CPU_KERNELS", "1") == "0":
        return "BATON_CPU_KERNELS=0"
    return _failed.get(name)


def serves(kernel: str, device: torch.device) -> Any:
    """The ops to call for `kernel` on `device`, or None where torch's ops serve."""
    if device.type != "cpu" or isa not in FASTER[kernel]:
        return None
    return ops()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
             residual: torch.Tensor | None, module: Any) -> torch.Tensor:
    """norm(x) or, with a residual, norm(x + residual) with the sum left in `residual`."""
    out = torch.empty_like(x)
    module.rms_norm(x.view(-1, x.shape[-1]), None if residual is None
                    else residual.view(-1, x.shape[-1]), weight, out.view(-1, x.shape[-1]),
                    eps, offset)
    return out


def silu_and_mul(gate_up: torch.Tensor, module: Any) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up]."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    module.silu_and_mul(gate_up, out)
    return out


def rope_and_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   views: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
                   kv_heads: int, module: Any) -> None:
    """RoPE on qk [T, heads, d] in place (its last kv_heads heads are k), then k and v into
    the cache's per-head views; cos and sin are [T, d/2]."""
    module.rope_and_cache(qk, v, cos, sin, *views, slots, kv_heads)


if __name__ == "__main__":  # `make install` builds the native ISA's; the image, --all
    # --all: every ISA this CPU runs (a build is loaded to register its ops, and a build
    # for an ISA the CPU lacks may not load).
    for name in supported() if "--all" in sys.argv[1:] else [isa]:
        built = ops(name)
        print(f"CPU kernels ({name}):", "built" if built is not None else f"unavailable "
              f"({failure(name)})")
