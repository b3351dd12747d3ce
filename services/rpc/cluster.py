"""The cluster token: the secret the router and the workers share, so that a worker can
tell its own cluster from anyone else who reaches its port.

    every call to a worker   carries it in metadata (`baton-cluster-token`), added by the
                             caller's channel (`aio_interceptors`, `intercept`); a worker
                             refuses a call without it, or with another, UNAUTHENTICATED
                             (`check`). Health and reflection stay open.
    the handshake            the decode worker sends a fresh nonce; the prefill worker
                             answers with an HMAC under the token over that nonce and all
                             it states (engine id, transport, transport metadata, and its
                             KV layout, tp_size included): `prove`. The decode worker
                             pulls only from a peer whose proof holds (`proven`), so a
                             caller cannot point it at a source of its own, nor change
                             what a member stated. A peer of the v1 proof fails it.

Tokens are compared in constant time. The token is plain metadata: without TLS, whoever
can watch the workers' network can read it. Keep that network private, or turn TLS on.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import namedtuple
from collections.abc import Callable

import grpc

from baton.kv_transfer.base import KVLayout

METADATA_KEY = "baton-cluster-token"
# Methods any caller may use: probes and tools must see a worker without the secret.
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
PROOF_LABEL = b"baton-handshake-v2"  # v2: the layout is covered


class ClusterToken:
    def __init__(self, token: str | None):
        self.token = token

    def __bool__(self) -> bool:
        return self.token is not None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((METADATA_KEY, self.token),) if self.token is not None else ()

    # ---- a worker's side -----------------------------------------------------------------

    def check(self) -> Callable[[str, object], str | None]:
        """For a worker's interceptor: (method, metadata) -> why the call is refused, or
        None. Without a token every call passes (a dev setup)."""
        token = self.token.encode() if self.token is not None else None

        def check(method: str, metadata) -> str | None:
            if token is None or method.startswith(OPEN_METHODS):
                return None
            given = next((v for k, v in metadata or () if k == METADATA_KEY), "")
            given = given.encode("utf-8", "replace") if isinstance(given, str) else given
            if hmac.compare_digest(given, token):
                return None
            return (f"this worker takes calls from its cluster only: metadata "
                    f"'{METADATA_KEY}' is {'wrong' if given else 'missing'}")

        return check

    def prove(self, nonce: bytes, engine_id: str, transport: str, metadata: bytes,
              layout: KVLayout) -> bytes:
        """A prefill worker's proof that it holds the token (b"" without one): an HMAC
        over the caller's nonce and the handshake's answer (the layout in its canonical
        encoding), each part length-prefixed."""
        if self.token is None or not nonce:
            return b""
        mac = hmac.new(self.token.encode(), PROOF_LABEL, hashlib.sha256)
        for part in (nonce, engine_id.encode(), transport.encode(), metadata,
                     layout.canonical):
            mac.update(len(part).to_bytes(8, "big") + part)
        return mac.digest()

    def proven(self, proof: bytes, nonce: bytes, engine_id: str, transport: str,
               metadata: bytes, layout: KVLayout) -> bool:
        """Whether `proof` is `prove(...)` of these values under our token."""
        want = self.prove(nonce, engine_id, transport, metadata, layout)
        return bool(want) and hmac.compare_digest(proof, want)

    # ---- a caller's side: the token on every call of a channel ----------------------------

    def aio_interceptors(self) -> list:
        # One per kind: an aio channel files an interceptor under the first kind it is.
        if self.token is None:
            return []
        return [_AioUnaryToken(self.token), _AioStreamToken(self.token)]

    def intercept(self, channel: grpc.Channel) -> grpc.Channel:
        return grpc.intercept_channel(channel, _SyncToken(self.token)) if self.token \
            else channel


class _AioToken:
    def __init__(self, token: str):
        self.token = token

    def _details(self, details):
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(METADATA_KEY, self.token)
        return details._replace(metadata=metadata)


class _AioUnaryToken(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioStreamToken(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _Details(namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                       "wait_for_ready", "compression")),
               grpc.ClientCallDetails):
    pass


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self.token = token

    def _details(self, d):
        return _Details(d.method, d.timeout, (*(d.metadata or ()), (METADATA_KEY, self.token)),
                        d.credentials, d.wait_for_ready, getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)
