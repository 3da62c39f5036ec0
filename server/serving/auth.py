"""Bearer-token check on every call, as a gRPC server interceptor."""

from __future__ import annotations

import hmac
import itertools
import logging
from collections.abc import Callable

import grpc

from tether.common.security import AUTH_METADATA_KEY, bearer, check_token
from tether.protos import tether_pb2 as pb

__all__ = ["OPEN_METHOD_PREFIXES", "TokenAuthInterceptor"]

log = logging.getLogger(__name__)

# Left open: Kubernetes gRPC probes carry no credentials, and health tells nothing about the model.
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)
_SERVICE = "/tether.v1.ParameterServer/"
# Metric labels take only these names, so a caller cannot mint label values.
_RPCS = frozenset(pb.DESCRIPTOR.services_by_name["ParameterServer"].methods_by_name)
# Log the first rejection and then one in this many: a flood must not flood the log.
_LOG_EVERY = 1000


def _deny(request: bytes, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (send 'authorization: Bearer <token>')")


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Answers UNAUTHENTICATED unless a call carries ``authorization: Bearer <token>``."""

    def __init__(
        self,
        token: str,
        open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        """Build the interceptor.

        Args:
            token: the shared secret.
            open_prefixes: method paths served without a token.
            on_reject: told the rejected RPC's name ("unknown" outside our service), for metrics.
        """
        self._expected = bearer(check_token(token)).encode()
        self._open = open_prefixes
        self._on_reject = on_reject
        # No deserializer: a rejected request is never parsed.
        self._denied = grpc.unary_unary_rpc_method_handler(_deny)
        self._rejections = itertools.count()

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = details.method or ""
        if method.startswith(self._open):
            return continuation(details)
        presented = b""
        for key, value in details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else bytes(value)
                break
        # Constant-time comparison: the time taken says nothing about how much of a guess matched.
        if hmac.compare_digest(presented, self._expected):
            return continuation(details)
        name = method[len(_SERVICE):] if method.startswith(_SERVICE) else ""
        rpc = name if name in _RPCS else "unknown"
        n = next(self._rejections)
        if n % _LOG_EVERY == 0:
            log.warning("rejected a %s call without a valid token (%d rejected so far)", rpc, n + 1)
        if self._on_reject is not None:
            self._on_reject(rpc)
        return self._denied
