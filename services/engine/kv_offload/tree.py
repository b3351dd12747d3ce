"""The names of a tier's files (store.py draws the tree): a block's key and where it
lives, and a walk that tells the tier's own files from anything else under its root.
Torch-free."""

from __future__ import annotations

import os
import re
import stat

from .block_file import KEY_FILE

SUFFIX, TMP_SUFFIX = ".kv", ".tmp"
PART = re.compile(r"[0-9A-Za-z_-][0-9A-Za-z_.-]{0,127}")  # no leading dot: no "..", no temp
KEY_ID = re.compile(r"[0-9a-f]{16}")  # block_file.key_id


def split_key(key: str) -> tuple[str, str]:
    """"<namespace>/<hash>" -> its two parts, or ValueError: each part of [0-9A-Za-z_.-],
    1 to 128 characters, not starting with a dot, exactly one "/"."""
    parts = key.split("/") if isinstance(key, str) else []
    if len(parts) != 2 or not all(PART.fullmatch(p) for p in parts):
        raise ValueError(f"bad KV store key {key!r}: want <namespace>/<hash>, each part of "
                         "[0-9A-Za-z_.-] (1-128 characters, no leading dot)")
    return parts[0], parts[1]


def walk(root, key_id: str):
    """(kind, path, stat, key) for every file under `root` but its lock and key file, as
    the store whose key is `key_id` sees them: kind "block" (key "" where another key's),
    "tmp", or "stray" (key ""): another name, a link, a folder where a file goes, a file
    another user owns. The tier's files are this user's blocks and temp files alone."""
    uid = os.geteuid()
    for top in entries(root):
        if top.name in (".lock", KEY_FILE):
            continue
        if not (KEY_ID.fullmatch(top.name) and top.is_dir(follow_symlinks=False)):
            yield from _stray(top)
            continue
        for ns in entries(top.path):
            if not (PART.fullmatch(ns.name) and ns.is_dir(follow_symlinks=False)):
                yield from _stray(ns)
                continue
            own = ns.name if top.name == key_id else ""
            for shard in entries(ns.path):
                if not shard.is_dir(follow_symlinks=False):
                    yield from _stray(shard)
                    continue
                for f in entries(shard.path):
                    yield from _kind(own, shard.name, f, uid)


def entries(path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _stray(entry: os.DirEntry):
    try:
        yield "stray", entry.path, entry.stat(follow_symlinks=False), ""
    except FileNotFoundError:
        pass


def _kind(ns: str, shard: str, entry: os.DirEntry, uid: int):
    """A file of a shard folder as walk names it (`ns` "": another key's)."""
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return
    name = entry.name
    stem = name.removesuffix(SUFFIX)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
        yield "stray", entry.path, st, ""
    elif name.endswith(SUFFIX) and PART.fullmatch(stem) and stem[:2] == shard:
        yield "block", entry.path, st, f"{ns}/{stem}" if ns else ""
    elif name.startswith(".") and name.endswith(TMP_SUFFIX):
        yield "tmp", entry.path, st, ""
    else:
        yield "stray", entry.path, st, ""
