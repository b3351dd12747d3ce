"""The TCP sockets a process listens on, read from /proc (what `ss -ltnp` shows), so a test
can say that a group listens on loopback only."""

from __future__ import annotations

import os
import socket


def listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket process `pid` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    out = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}") as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                out.add(_address(local, family))
    return out


def _address(hex_address: str, family: int) -> tuple[str, int]:
    """/proc's "0100007F:1F90" (each 32-bit word in host order) as ("127.0.0.1", 8080)."""
    ip, port = hex_address.split(":")
    raw = bytes.fromhex(ip)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw), int(port, 16)
