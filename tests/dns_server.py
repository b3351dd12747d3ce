"""A tiny authoritative DNS server on loopback UDP, for discovery tests: names map to A
records the test changes while the router runs (as a headless Service's do when pods
come and go). Unknown names get NXDOMAIN."""

from __future__ import annotations

import socket
import threading

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class DnsServer:
    def __init__(self):
        self.records: dict[str, list[str]] = {}  # name (no trailing dot) -> IPv4/v6 addresses
        self.queries = 0
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def set(self, name: str, ips: list[str]) -> None:
        with self._lock:
            self.records[name] = list(ips)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(4096)
            except (TimeoutError, OSError):
                continue
            try:
                query = dns.message.from_wire(data)
            except Exception:  # not DNS: ignore it
                continue
            self._sock.sendto(self._answer(query).to_wire(), peer)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.AA
        question = query.question[0]
        name = question.name.to_text().rstrip(".")
        with self._lock:
            self.queries += 1
            ips = self.records.get(name)
        if ips is None:
            reply.set_rcode(dns.rcode.NXDOMAIN)
            return reply
        kind = {dns.rdatatype.A: "A", dns.rdatatype.AAAA: "AAAA"}.get(question.rdtype)
        found = [ip for ip in ips if (":" in ip) == (kind == "AAAA")]
        if kind and found:
            reply.answer.append(dns.rrset.from_text_list(question.name, 1, "IN", kind, found))
        return reply  # else no records, NOERROR

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
