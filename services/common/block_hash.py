"""Chained block hashes for the prefix cache.

hash(block i) = sha256(hash(block i-1) || token ids of block i || extra keys), where the
extra keys are the request's cache salt and the LoRA adapter it runs (extra_keys). The chain makes a
block's hash name its whole prefix, not only its own tokens. sha256 is collision
resistant, so a hit is trusted without comparing token ids.
"""

from __future__ import annotations

import hashlib
import struct

ROOT = b"baton-prefix-cache-v1"


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    h = hashlib.sha256(parent if parent is not None else ROOT)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(struct.pack("<q", len(extra)))
    h.update(extra)
    return h.digest()


def extend_hashes(hashes: list[bytes], token_ids: list[int], block_size: int,
                  extra: bytes = b"") -> None:
    """Append the hashes of every full block of `token_ids` not yet hashed."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[start:start + block_size], extra))


def extra_keys(cache_salt: str = "", lora_name: str = "") -> bytes:
    """What a request's block hashes fold in besides its tokens: its cache salt (tenants
    never share a block) and its LoRA adapter's name (an adapter computes other KV for the
    same tokens). The salt's length comes first, so no salt can spell another pair."""
    if not cache_salt and not lora_name:
        return b""
    salt = cache_salt.encode()
    return struct.pack("<q", len(salt)) + salt + lora_name.encode()
