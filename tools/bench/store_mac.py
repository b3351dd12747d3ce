"""The KV tiers' block MAC against the CRC32 it replaced (issue 52): put + get of blocks
the default model's size through a BlockStore in shared memory, with the MAC
(HMAC-SHA256, services/engine/kv_offload/block_file.py) and with a CRC32 in its place,
in the same process, rounds alternating; then each digest alone over one block.

    python -m baton.tools.bench.store_mac [--blocks 200] [--rounds 7]

Prints the best round of each (microseconds per block, put and get together) and their
ratio, with the CPU and the flags the digests hinge on: sha_ni (SHA-256 in hardware),
pclmulqdq and vpclmulqdq (zlib's CRC32).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import os
import shutil
import tempfile
import time
import zlib

from baton.services.engine.kv_offload import block_file
from baton.services.engine.kv_offload.store import BlockStore
from baton.services.engine.private_files import shared_memory_dir

from .machine import cpu_line

# One block of the default model (SmolLM2-135M): layers x K|V x KV heads x tokens x
# head dim x 2 bytes (bf16), as kv_connector/offload.py saves it per rank.
LAYERS, KV_HEADS, BLOCK, HEAD_DIM = 30, 3, 16, 64
BLOCK_BYTES = LAYERS * 2 * KV_HEADS * BLOCK * HEAD_DIM * 2
DIGEST_FLAGS = ("sha_ni", "pclmulqdq", "vpclmulqdq", "avx512f", "avx2")


def crc32_as_mac(mac_key: bytes, head: bytes, payload) -> bytes:
    """What version 1 checked (a CRC32 over header and payload), in the MAC's place."""
    return zlib.crc32(payload, zlib.crc32(head)).to_bytes(4, "little") * 8


@contextlib.contextmanager
def digest(name: str):
    """block_file's MAC as it is ("hmac-sha256"), or the CRC32 in its place ("crc32")."""
    real = block_file.mac
    if name == "crc32":
        block_file.mac = crc32_as_mac
    try:
        yield
    finally:
        block_file.mac = real


def one_round(blocks: int, data: bytes) -> float:
    """Microseconds per block to put `blocks` blocks into a new store, then get them."""
    root = tempfile.mkdtemp(prefix="baton-bench-mac-", dir=shared_memory_dir())
    try:
        store = BlockStore(os.path.join(root, "tier"), 2 * blocks * (len(data) + 4096),
                           "host")
        keys = [f"bench-r0of1/{i:032x}" for i in range(blocks)]
        t0 = time.perf_counter()
        for k in keys:
            assert store.put(k, data)
        for k in keys:
            assert store.get(k, len(data)) is not None
        elapsed = time.perf_counter() - t0
        store.close()
        return elapsed / blocks * 1e6
    finally:
        shutil.rmtree(root)


def digest_alone(data: bytes, repeat: int = 200) -> dict[str, float]:
    """Microseconds per block for each digest by itself, best of `repeat`."""
    key = os.urandom(32)
    fns = {"crc32": lambda: zlib.crc32(data),
           "hmac-sha256": lambda: hmac.digest(key, data, "sha256"),
           "blake2b keyed": lambda: hashlib.blake2b(data, key=key).digest()}
    out = {}
    for name, fn in fns.items():
        fn()
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = best * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=200, help="blocks per round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of each, alternating")
    args = ap.parse_args()
    data = os.urandom(BLOCK_BYTES)
    best = {"crc32": float("inf"), "hmac-sha256": float("inf")}
    for _ in range(args.rounds):
        for name in best:
            with digest(name):
                best[name] = min(best[name], one_round(args.blocks, data))
    print(cpu_line(DIGEST_FLAGS))
    print(f"block: {BLOCK_BYTES} bytes, {args.blocks} a round, best of {args.rounds} rounds; "
          f"store in {shared_memory_dir()}")
    crc, mac = best["crc32"], best["hmac-sha256"]
    print(f"put + get per block: crc32 {crc:.0f} us, hmac-sha256 {mac:.0f} us, "
          f"ratio {mac / crc:.2f}x")
    alone = digest_alone(data)
    print("digest alone per block: " + ", ".join(f"{k} {v:.0f} us" for k, v in alone.items()))


if __name__ == "__main__":
    main()
