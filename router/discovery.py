"""Where the workers are: fixed addresses, or DNS names whose records change.

    host:port                       one worker, as given (gRPC resolves the host itself)
    dns:///name:port                one worker per A/AAAA record of name, from the
                                    system's resolver (a Kubernetes headless Service,
                                    compose's service names)
    dns://server[:53]/name:port     the same, asking that DNS server

Every `interval` seconds each DNS name is resolved again; the registry adds the workers
that appeared and retires those that vanished. A lookup that fails (timeout, SERVFAIL)
keeps the workers it found before; a name that does not exist (NXDOMAIN) or has no
records means none, as a Service with no ready pods (the registry keeps the workers it
had for --discovery-grace seconds first: one bad answer must not retire them all). A
name with IPv4 and IPv6 records counts its IPv4 ones only (a dual-stack pod has both: it
is one worker).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.resolver

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    text: str
    host: str
    port: int
    dns: bool = False  # re-resolved; else a fixed address
    server: tuple[str, int] | None = None  # the DNS server to ask; None: the system's

    @staticmethod
    def parse(text: str) -> Target:
        """A flag's value as a Target; ValueError says what is wrong with it."""
        text = text.strip()
        rest, dns_name, server = text, False, None
        if text.startswith("dns:"):
            dns_name = True
            if not text.startswith("dns://"):
                raise ValueError(f"{text!r}: write dns:///name:port (or dns://server/name:port)")
            authority, _, rest = text[len("dns://"):].partition("/")
            if authority:
                shost, sport = _split(authority, default_port=53)
                try:
                    ipaddress.ip_address(shost)
                except ValueError:
                    raise ValueError(f"{text!r}: the DNS server must be an IP address, "
                                     f"not {shost!r}") from None
                server = (shost, sport)
        host, port = _split(rest)
        return Target(text, host, port, dns_name, server)


def _split(hostport: str, default_port: int | None = None) -> tuple[str, int]:
    if hostport.startswith("["):  # [v6]:port
        host, _, tail = hostport[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", "")
    if not port:
        if default_port is None:
            raise ValueError(f"{hostport!r}: needs a port (host:port)")
        port = str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{hostport!r}: not host:port")
    return host, int(port)


def address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


async def resolve(target: Target, timeout: float = 2.0) -> list[str]:
    """The worker addresses `target` names now, sorted. Raises OSError when the lookup
    failed (the caller keeps what it knew)."""
    if not target.dns:
        return [target.text]  # as given: gRPC resolves it (and [v6]:port stays so)
    try:
        ip = ipaddress.ip_address(target.host)
        return [address(str(ip), target.port)]  # an IP needs no lookup
    except ValueError:
        pass
    if target.server is None:
        try:
            infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(
                target.host, target.port, type=socket.SOCK_STREAM), timeout)
        except socket.gaierror as e:
            if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5)):
                return []
            raise OSError(f"resolving {target.host}: {e}") from None
        except TimeoutError:
            raise OSError(f"resolving {target.host}: timed out") from None
        return _one_family({str(info[4][0]) for info in infos}, target.port)
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [target.server[0]]
    resolver.port = target.server[1]
    resolver.lifetime = timeout
    found: set[str] = set()
    for rdtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(target.host, rdtype)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue
        except dns.exception.DNSException as e:
            raise OSError(f"resolving {target.host} at {target.server[0]}: {e}") from None
        found |= {r.address for r in answer}
    return _one_family(found, target.port)


def _one_family(ips: set[str], port: int) -> list[str]:
    """IPv4 addresses if there are any, else IPv6: a dual-stack pod has one of each, and
    is one worker, not two."""
    v4 = {ip for ip in ips if ipaddress.ip_address(ip).version == 4}
    return sorted(address(ip, port) for ip in (v4 or ips))
