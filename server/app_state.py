"""What the HTTP app needs from the running coordinator, in one object."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hangwatch.analyzer.report import Report
from hangwatch.server.incidents.store import IncidentStore
from hangwatch.server.integrations.metrics import Metrics
from hangwatch.server.live.registry import JobRegistry
from hangwatch.server.live.stragglers import StragglerMonitor

from hangwatch.config import Config


@dataclass(kw_only=True)
class ServerContext:
    config: Config
    store: IncidentStore
    registry: JobRegistry
    data_dir: Path
    metrics: Metrics
    grpc_address: str  # "host:port": the context is built once both are bound
    http_address: str = ""  # "http://host:port"
    stragglers: StragglerMonitor | None = None
    # Builds a bundle's trace-event document; the coordinator's runs in its
    # capped analyzer process (None: in this process, for harnesses without one).
    trace: Callable[[Path, Report | None], dict[str, Any]] | None = None
