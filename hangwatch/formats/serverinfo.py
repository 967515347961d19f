"""Files in which a running hangwatch process says who it is.

* `<data_dir>/server.json` (ServerInfo): where a running coordinator listens.
  Written once both its ports are bound; read by the demo, the benchmarks and
  whoever wants to find a coordinator started with port 0.
* `<run_dir>/agent.json` (AgentInfo): the job a node's agent reports its
  ranks under. Written as the agent starts; read by `hangwatch run`, which
  takes its job id from there when given none (issue 24: ranks said job
  `default` under an agent told `myjob`, and nothing warned).

Readers: a file without a schema tag is read; unknown keys are ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Self

from hangwatch.formats import checks as c
from hangwatch.formats.files import AGENT_FILE, SERVER_FILE, atomic_write

SERVER_INFO = "hangwatch.serverinfo/1"
AGENT_INFO = "hangwatch.agentinfo/1"
MAX_SERVER_INFO_BYTES = 64 * 1024


class _ProcessFile:
    """What ServerInfo and AgentInfo share: a schema-tagged JSON file a running
    process writes atomically into its directory, and readers load."""

    FILE: ClassVar[str]
    SCHEMA: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        return {"schema": self.SCHEMA, **asdict(self)}  # type: ignore[call-overload]

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), indent=2).encode()

    @classmethod
    def from_json(cls, d: Any) -> Self:
        raise NotImplementedError

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        return cls.from_json(c.loads(data, cls.SCHEMA, MAX_SERVER_INFO_BYTES))

    def write(self, directory: str | os.PathLike[str]) -> None:
        atomic_write(os.path.join(directory, self.FILE), self.to_bytes())

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Self:
        """Raises OSError (absent, unreadable) or FormatError (damaged)."""
        return cls.from_json(
            c.read_file(os.path.join(directory, cls.FILE), cls.SCHEMA, MAX_SERVER_INFO_BYTES)
        )


@dataclass(frozen=True, kw_only=True)
class ServerInfo(_ProcessFile):
    grpc: str  # HOST:PORT the agents dial
    http: str  # http://HOST:PORT of the dashboard and API
    pid: int
    started_unix: float  # the coordinator's clock

    FILE: ClassVar[str] = SERVER_FILE
    SCHEMA: ClassVar[str] = SERVER_INFO

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
    def read(cls, data_dir: str | os.PathLike[str]) -> ServerInfo | None:
        """The file's contents; None while it is absent or half-written."""
        try:
            return cls.load(data_dir)
        except (OSError, c.FormatError):
            return None


@dataclass(frozen=True, kw_only=True)
class AgentInfo(_ProcessFile):
    job_id: str  # what the agent reports its ranks under
    node_id: str  # the agent's id at the coordinator
    coordinator: str  # HOST:PORT it reports to
    pid: int
    proc_starttime: int  # /proc/<pid>/stat field 22: a reused pid is not this agent

    FILE: ClassVar[str] = AGENT_FILE
    SCHEMA: ClassVar[str] = AGENT_INFO

    @classmethod
    def from_json(cls, d: Any) -> AgentInfo:
        s = AGENT_INFO
        d = c.document(d, s)
        return cls(
            job_id=c.req_str(d, "job_id", s),
            node_id=c.get_str(d, "node_id", s),
            coordinator=c.get_str(d, "coordinator", s),
            pid=c.req_int(d, "pid", s, minimum=1),
            proc_starttime=c.get_int(d, "proc_starttime", s, 0, minimum=0),
        )
