"""`<data_dir>/server.json`: where a running coordinator listens.

Written by the coordinator once both its ports are bound; read by the demo,
the benchmarks and whoever wants to find a coordinator started with port 0.
Readers: a file without a schema tag is read; unknown keys are ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from hangwatch.formats import checks as c
from hangwatch.formats.files import SERVER_FILE, atomic_write

SERVER_INFO = "hangwatch.serverinfo/1"
MAX_SERVER_INFO_BYTES = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class ServerInfo:
    grpc: str  # HOST:PORT the agents dial
    http: str  # http://HOST:PORT of the dashboard and API
    pid: int
    started_unix: float  # the coordinator's clock

    FILE: ClassVar[str] = SERVER_FILE
    SCHEMA: ClassVar[str] = SERVER_INFO

    def to_json(self) -> dict[str, Any]:
        return {"schema": SERVER_INFO, **asdict(self)}

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), indent=2).encode()

    @classmethod
    def from_json(cls, d: Any) -> ServerInfo:
        s = SERVER_INFO
        d = c.document(d, s)
        return cls(
            grpc=c.req_str(d, "grpc", s),
            http=c.req_str(d, "http", s),
            pid=c.req_int(d, "pid", s, minimum=1),
            started_unix=c.get_float(d, "started_unix", s, 0.0),
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> ServerInfo:
        return cls.from_json(c.loads(data, SERVER_INFO, MAX_SERVER_INFO_BYTES))

    def write(self, data_dir: str | os.PathLike[str]) -> None:
        atomic_write(os.path.join(data_dir, self.FILE), self.to_bytes())

    @classmethod
    def read(cls, data_dir: str | os.PathLike[str]) -> ServerInfo | None:
        """The file's contents; None while it is absent or half-written."""
        try:
            return cls.from_json(
                c.read_file(os.path.join(data_dir, cls.FILE), SERVER_INFO, MAX_SERVER_INFO_BYTES)
            )
        except (OSError, c.FormatError):
            return None
