"""One KV block as a file of a tier (store.py), and the key its MAC is made with.

    | magic "BTKV" | version u16 | key_len u16 | payload_len u64 | key     | mac   | payload |
      4 bytes        2             2             8                 key_len   32      payload_len

mac = HMAC-SHA256(the tier's key; every byte before it, then the payload). The reader
knows the block's key and its payload's size: a header that says otherwise, or a file
whose size is not the header's sum, is corrupt, and its payload is not read; a MAC that
differs marks a block written without the tier's key (forged) or damaged since. Either
is a miss. (HMAC-SHA256 costs about what CRC32 did where the CPU has SHA instructions:
tools/bench/store_mac.py.)

The tier's key. With a cluster token: HMAC-SHA256(token, LABEL), which every worker of
the cluster derives and nothing else can. Without one: 32 random bytes in `<root>/.key`
(mode 0600, made once, by the first process that opens the tier, under its lock; never
through a link), read by every process of the user that owns the tier. Stores opened
with different keys on one root share its budget but never read each other's blocks:
the store keeps each key's blocks in a folder named by `key_id`.
"""

from __future__ import annotations

import hmac
import os
import secrets
import struct

from ..private_files import ForeignFile, open_own

MAGIC = b"BTKV"
VERSION = 2  # 1: a CRC32, which anyone can forge
HEAD = struct.Struct("<4sHHQ")  # magic, version, key length, payload length
MAC_BYTES = 32
KEY_BYTES = 32
KEY_FILE = ".key"
LABEL = b"baton kv tier block mac"  # the token's use here, so the MAC key is no other


class BadBlock(Exception):
    """A block file that is a miss; `reason` says why: "corrupt" or "forged"."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def tier_key(root: str, secret: str | None) -> bytes:
    """The key of the tier at `root`: derived from the cluster token `secret`, else the
    key file's (made if absent). ValueError if the key file is not this user's own."""
    if secret:
        return hmac.digest(secret.encode(), LABEL, "sha256")
    path = os.path.join(root, KEY_FILE)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return _read_key(path)
    try:
        os.fchmod(fd, 0o600)
        key = secrets.token_bytes(KEY_BYTES)
        os.write(fd, key)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return key


def _read_key(path: str) -> bytes:
    try:
        fd, st = open_own(path, os.O_RDONLY, private=True)
    except ForeignFile as e:
        raise ValueError(f"the KV tier's key file {path} {e.strerror}: remove it (a new "
                         "one is made) or choose another folder") from None
    try:
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise ValueError(f"the KV tier's key file {path} holds {len(key)} bytes, not "
                         f"{KEY_BYTES}: remove it (a new one is made)")
    return key


def key_id(mac_key: bytes) -> str:
    """A name for the key that tells nothing of it: 16 hex digits."""
    return hmac.digest(mac_key, b"key id", "sha256")[:8].hex()


def mac(mac_key: bytes, head: bytes, payload: memoryview | bytes) -> bytes:
    m = hmac.new(mac_key, head, "sha256")
    m.update(payload)
    return m.digest()


def header(mac_key: bytes, key: bytes, payload: memoryview) -> bytes:
    """Every byte of the block's file before its payload."""
    head = HEAD.pack(MAGIC, VERSION, len(key), payload.nbytes) + key
    return head + mac(mac_key, head, payload)


def read(f, mac_key: bytes, key: bytes, file_size: int, payload_size: int | None) -> bytes:
    """The payload of the block file open as `f` (`file_size` bytes long), which must be
    `key`'s and, unless None, hold `payload_size` bytes; else BadBlock."""
    head = f.read(HEAD.size)
    if len(head) != HEAD.size:
        raise BadBlock("corrupt")
    magic, version, key_len, length = HEAD.unpack(head)
    if magic != MAGIC or version != VERSION or key_len != len(key) \
            or payload_size not in (None, length) \
            or file_size != HEAD.size + key_len + MAC_BYTES + length:
        raise BadBlock("corrupt")
    rest = f.read(key_len + MAC_BYTES)
    if rest[:key_len] != key:
        raise BadBlock("corrupt")
    payload = f.read(length)
    if len(payload) != length:
        raise BadBlock("corrupt")
    if not hmac.compare_digest(rest[key_len:], mac(mac_key, head + key, payload)):
        raise BadBlock("forged")
    return payload
