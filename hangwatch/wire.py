"""The generated gRPC stubs under short names: `pb` (messages) and `rpc` (service)."""

from hangwatch._proto.hangwatch.v1 import hangwatch_pb2 as pb
from hangwatch._proto.hangwatch.v1 import hangwatch_pb2_grpc as rpc

__all__ = ["pb", "rpc"]
