"""gRPC adapter of a shard: each ``tether.v1.ParameterServer`` method handed to the request
handler, and its errors turned into the call's status."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.server.serving.handler import Outcome, RequestHandler, Unparsable

__all__ = ["SERVICE_NAME", "ShardServicer", "add_servicer"]

SERVICE_NAME = "tether.v1.ParameterServer"


def _lenient(cls: Any) -> Callable[[bytes], object]:
    """A request deserializer that hands bad bytes to the servicer instead of failing in grpc."""

    def parse(data: bytes) -> object:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Unparsable(cls.DESCRIPTOR.full_name, len(data), str(exc))

    return parse


def add_servicer(servicer: ShardServicer, server: grpc.Server) -> None:
    """Register ``servicer`` like the generated ``add_ParameterServerServicer_to_server``, except
    that undecodable requests reach it, to be answered INVALID_ARGUMENT (grpc says INTERNAL)."""
    service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, m.name),
            request_deserializer=_lenient(getattr(pb, m.input_type.name)),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString,
        )
        for m in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


class ShardServicer(pb_grpc.ParameterServerServicer):
    """Implements ``tether.v1.ParameterServer`` with a ``RequestHandler``."""

    def __init__(self, handler: RequestHandler) -> None:
        self.handler = handler

    def _unary(self, rpc: str, request: Any, context: grpc.ServicerContext) -> Any:
        return _answer(self.handler.call(rpc, request), context)

    def Declare(self, request: pb.DeclareRequest, context: grpc.ServicerContext) -> pb.DeclareResponse:
        return self._unary("Declare", request, context)

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> pb.PullResponse:
        return self._unary("Pull", request, context)

    def Push(self, request: pb.PushRequest, context: grpc.ServicerContext) -> pb.PushResponse:
        return self._unary("Push", request, context)

    def PushPull(self, request: pb.PushPullRequest, context: grpc.ServicerContext) -> pb.PushPullResponse:
        return self._unary("PushPull", request, context)

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        return self._unary("Info", request, context)

    def Clock(self, request: pb.ClockRequest, context: grpc.ServicerContext) -> pb.ClockResponse:
        return self._unary("Clock", request, context)

    def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> pb.CheckpointResponse:
        return self._unary("Checkpoint", request, context)


def _answer(outcome: Outcome, context: grpc.ServicerContext) -> Any:
    """The response of a handled call, or the call aborted with the error's status."""
    response, code, message = outcome
    if code != grpc.StatusCode.OK:
        context.abort(code, message)
    return response
