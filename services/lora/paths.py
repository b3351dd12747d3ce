"""Where a caller may point a LoRA adapter load, checked alike by the router and the engine
(torch-free).

A path a caller sends (a run-time load, or the directory the router sends with a request)
is read only where it lies beneath `--lora-root` once every symlink is resolved (the
directory and each file read in it), so neither `..` nor a link leads out. Every path the
server cannot read for the caller (absent, not a directory, not an adapter, a file
missing or unreadable, outside the root) is refused with the one message below and the
one status (INVALID_ARGUMENT): the answer tells a caller nothing of the file system. The
operator's own paths (`--lora-modules`, the offline API) are read wherever they are, with
the real reason.
"""

from __future__ import annotations

import os

UNREADABLE = ("lora_path: not a LoRA adapter directory this server may read (it must lie "
              "beneath --lora-root)")


class Unreadable(ValueError):
    """A caller's adapter path that cannot be read for it; `str()` is always UNREADABLE.
    `reason` says why, for the server's log only."""

    def __init__(self, reason: str = ""):
        super().__init__(UNREADABLE)
        self.reason = reason


def beneath(root: str, path: str) -> str:
    """`path` (absolute, or relative to `root`) with every symlink resolved, if that lies
    beneath `root` (resolved too); else Unreadable."""
    if not isinstance(path, str) or not path:
        raise Unreadable("no path")
    try:
        top = os.path.realpath(root)
        real = os.path.realpath(os.path.join(top, path))
    except (OSError, ValueError) as e:  # a NUL byte, a symlink loop
        raise Unreadable(f"{path!r} does not resolve ({e})") from None
    if os.path.commonpath([top, real]) != top:
        raise Unreadable(f"{path!r} resolves to {real!r}, outside --lora-root {top!r}")
    return real
