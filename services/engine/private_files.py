"""Files in places every local user reaches (/dev/shm, /tmp, a shared disk): a folder
this process's user alone may enter, and files opened never through a symbolic link nor
blocking on a FIFO, then checked to be this user's regular files. Whatever another user
made there first (the folder itself, a link, a FIFO, a file of theirs) is refused, never
followed. Torch-free."""

from __future__ import annotations

import errno
import os
import stat
import tempfile


class ForeignFile(OSError):
    """A path that is not what this process's user made: a link, a FIFO, a device,
    another user's file, a file others may read."""


def shared_memory_dir() -> str:
    """Where files every process of the host can map live: /dev/shm (tmpfs), else the
    temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def problems(st: os.stat_result, kind: str, private: bool) -> list[str]:
    """What is wrong with a file (`kind` "file") or folder (`kind` "folder") of this
    process's user that `private` says no one else may open; [] if nothing."""
    uid, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    found = []
    if stat.S_ISLNK(st.st_mode):
        found.append("is a symbolic link")
    elif not (stat.S_ISDIR if kind == "folder" else stat.S_ISREG)(st.st_mode):
        found.append(f"is not a {'folder' if kind == 'folder' else 'regular file'}")
    if st.st_uid != uid:
        found.append(f"is owned by uid {st.st_uid}, not by this process's uid {uid}")
    if private and mode & 0o077:
        want = "0700" if kind == "folder" else "0600"
        found.append(f"has mode {mode:04o}: group or others may open it (want {want})")
    return found


def private_folder(path: str, what: str) -> None:
    """Make the folder `path` (mode 0700, its missing parents as mkdir -p makes them) if
    it is absent; ValueError naming `what` and each problem unless it is a folder of this
    process's user, not a symbolic link, that no one else may enter."""
    try:
        os.mkdir(path, 0o700)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    found = problems(os.lstat(path), "folder", private=True)
    if found:
        raise ValueError(f"{what} {path} {'; '.join(found)}: it must be this user's own "
                         "folder, mode 0700 (another user may have made it first); remove "
                         "it or choose another folder")


def open_own(path: str, flags: int, private: bool = False,
             mode: int = 0o600) -> tuple[int, os.stat_result]:
    """`path` opened with `flags` (O_CREAT makes it `mode`), and its stat. ForeignFile
    (nothing left open) if it is a symbolic link, not a regular file, another user's, or
    (`private`) open to others; other OSErrors as os.open raises them."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ForeignFile(e.errno, "is a symbolic link", path) from None
        raise
    st = os.fstat(fd)
    found = problems(st, "file", private)
    if found:
        os.close(fd)
        raise ForeignFile(errno.EPERM, "; ".join(found), path)
    return fd, st
