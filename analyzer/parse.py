"""One flight-recorder dump, bytes in, normalized entries out.

The work is done in three stages, one module each: `sniff` (pickle or JSON,
by content), `coded` (string columns as codes into distinct values) and
`decode` (a decoded dump object into `ParsedDump` columns). This module is
`parse_dump_bytes`, the one-call form that returns plain Python values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hangwatch.analyzer.coded import Coded
from hangwatch.analyzer.decode import (
    ENTRY_COLUMNS,
    decode_dump,
)
from hangwatch.analyzer.sniff import sniff_and_decode


def parse_dump_bytes(data: bytes) -> dict[str, Any]:
    """Sniff pickle vs JSON, validate the shape and normalize one dump.

    Returns {"version", "comm_lib_version", "backend", "pg_config",
    "pg_status": {pg_id: {"last_enqueued", "last_started", "last_completed"}},
    "entries": [normalized entry dicts with the loader's column names]}.
    Raises DumpFormatError (a ValueError) with a one-line reason.
    """
    parsed = decode_dump(sniff_and_decode(data))
    cols = parsed.columns
    as_lists = {
        k: (v.strings() if isinstance(v, Coded) else list(np.asarray(v))) for k, v in cols.items()
    }
    entries = []
    for i in range(parsed.n_entries):
        e: dict[str, Any] = {}
        for k in ENTRY_COLUMNS:
            v = as_lists[k][i]
            if isinstance(v, np.generic):
                v = v.item()
            e[k] = v
        if e["record_id"] in parsed.frames:
            e["frames"] = [
                {"name": a, "filename": b, "line": c} for a, b, c in parsed.frames[e["record_id"]]
            ]
        entries.append(e)
    return {
        "version": parsed.version,
        "comm_lib_version": parsed.comm_lib_version,
        "backend": parsed.backend,
        "pg_config": parsed.pg_config,
        "pg_status": {
            k: {"last_enqueued": a, "last_started": b, "last_completed": c}
            for k, (a, b, c) in parsed.pg_status.items()
        },
        "entries": entries,
    }
