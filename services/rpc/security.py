"""Who may call: API keys on the public API, TLS on every port, mutual TLS between the
router and the workers.

    public (router, colocated)   TLS with --tls-cert/--tls-key (no client certificate);
                                 `Authorization: Bearer <key>` when --api-key is set,
                                 on gRPC metadata and HTTP alike; else UNAUTHENTICATED /
                                 401 and nothing is queued. Health and metrics stay open.
    internal (workers)           with --tls-ca, a caller must show a certificate signed
                                 by that CA; the router and the decode workers present
                                 theirs (--tls-cert/--tls-key) when they call a worker.
                                 A worker dialed by IP (found by DNS) must show a
                                 certificate for --tls-server-name, when given.
                                 With --cluster-token, every call but health must carry
                                 the token (services/rpc/cluster.py). Both may be on.

NIXL moves KV blocks outside gRPC, unencrypted: keep the workers' network private.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc

from .cluster import ClusterToken
from .config import ServiceConfig
from .server import CHANNEL_OPTIONS


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def load_keys(keys: Iterable[str], key_file: str | None) -> tuple[str, ...]:
    """API keys from flags and from a file (one a line; blank lines and # comments)."""
    found = [k for k in keys if k]
    if key_file:
        for line in Path(key_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.append(line)
    return tuple(found)


def key_id(key: str) -> str:
    """A name for an API key that does not give it away (an HMAC keyed with the key
    itself), the same in every router: what the router knows its callers by, and their
    prefix cache namespace. Never the key itself, in logs or on the way to a worker."""
    return hmac.new(key.encode(), b"baton-api-key-id", hashlib.sha256).hexdigest()[:32]


class Security:
    def __init__(self, service: ServiceConfig, api_keys: tuple[str, ...] = ()):
        self.cert, self.key = _read(service.tls_cert), _read(service.tls_key)
        self.ca = _read(service.tls_ca)
        self.server_name = service.tls_server_name  # what the workers' certificates name
        self.cluster = ClusterToken(service.cluster_secret())
        self.api_keys = api_keys
        self._key_ids = {k: key_id(k) for k in api_keys}

    @staticmethod
    def of(config) -> Security:
        """From a RouterConfig or a WorkerConfig (the latter has no API keys)."""
        keys = load_keys(getattr(config, "api_keys", ()), getattr(config, "api_key_file", None))
        return Security(config.service, keys)

    # ---- API keys ----------------------------------------------------------------------

    def key_ok(self, authorization: str | None) -> bool:
        """Whether an `Authorization` value carries one of the keys (always, with none)."""
        return self.key_id(authorization) is not None

    def key_id(self, authorization: str | None) -> str | None:
        """Which key an `Authorization` value carries, as `key_id(key)` ("" with no keys
        configured: every caller is the same); None when it carries none of them."""
        if not self.api_keys:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode("utf-8", "replace")
        if scheme.lower() != "bearer":
            return None
        return next((self._key_ids[k] for k in self.api_keys
                     if hmac.compare_digest(given, k.encode())), None)

    def grpc_key_id(self, metadata) -> str | None:
        """`key_id` of a gRPC call's `authorization` metadata."""
        return self.key_id(next((v for k, v in metadata or () if k == "authorization"), None))

    def grpc_check(self, methods: Iterable[str]) -> Callable[[str, tuple], str | None]:
        """For the interceptor: (method, metadata) -> why the call is refused, or None."""
        guarded = set(methods)

        def check(method: str, metadata) -> str | None:
            if method not in guarded or self.grpc_key_id(metadata) is not None:
                return None
            return "a valid API key is required: metadata 'authorization: Bearer <key>'"

        return check

    # ---- TLS ---------------------------------------------------------------------------

    def server_credentials(self, public: bool) -> grpc.ServerCredentials | None:
        if self.cert is None or self.key is None:  # ServiceConfig: both or neither
            return None
        mutual = self.ca is not None and not public
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca if mutual else None,
            require_client_auth=mutual)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """For calls to a worker: TLS when this service has a certificate (the workers'
        are checked against --tls-ca, else the system's roots), showing ours."""
        if self.cert is None and self.ca is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    @property
    def verifies_peers(self) -> bool:
        """Whether this service tells its cluster from strangers: by the cluster token
        (and a prefill worker's proof of it), or by certificates checked against
        --tls-ca."""
        return bool(self.cluster) or self.ca is not None

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        """A channel to a worker: TLS as above, the cluster token on every call."""
        creds, interceptors = self.channel_credentials(), self.cluster.aio_interceptors()
        if creds is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS,
                                             interceptors=interceptors)
        return grpc.aio.secure_channel(address, creds, options=self._tls_options(),
                                       interceptors=interceptors)

    def channel(self, address: str) -> grpc.Channel:
        """`aio_channel`'s blocking twin (the receiver's threads)."""
        creds = self.channel_credentials()
        channel = (grpc.insecure_channel(address, options=CHANNEL_OPTIONS) if creds is None
                   else grpc.secure_channel(address, creds, options=self._tls_options()))
        return self.cluster.intercept(channel)

    def _tls_options(self) -> list[tuple[str, object]]:
        if self.server_name is None:
            return CHANNEL_OPTIONS
        return [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", self.server_name)]


def client_credentials(ca: str | None = None, cert: str | None = None,
                       key: str | None = None) -> grpc.ChannelCredentials | None:
    """TLS for a tool that calls a service (`baton health`, `generate`, `up`): None
    (plaintext) without any of the files."""
    if not (ca or cert):
        return None
    return grpc.ssl_channel_credentials(_read(ca), _read(key), _read(cert))
