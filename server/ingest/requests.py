"""A streaming call's requests, read one at a time and each let go once taken.

A parsed message holds a copy of its bytes in protobuf's own memory (upb's
arena: C memory, which tracemalloc does not see), a field read out of it (a
chunk's `data`) is a second copy, and any sub-message still referenced keeps
the whole arena. gRPC's request iterator keeps the last message it gave
until the next one arrives, and so does a handler's `async for` variable.
Read that way, every open stream holds its last message for as long as it
waits: one upload of a node's archive (~145 KB, one message) held twice,
parsed and copied, through its write and two syncs; a relay's last batch of
reports; an agent's last report. Here the handler holds the only reference
and drops it (`del`) before it reads the next one.
"""

from __future__ import annotations

from typing import Any, TypeVar

import grpc

RequestT = TypeVar("RequestT")


async def next_request(context: grpc.aio.ServicerContext[RequestT, Any]) -> RequestT | None:
    """The call's next request; None once the client has closed its side.
    Not to be mixed with the handler's request iterator on the same call."""
    msg = await context.read()
    return None if msg is grpc.aio.EOF else msg
