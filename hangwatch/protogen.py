"""Regenerate the committed gRPC stubs from proto/ (needs grpcio-tools).

`python -m hangwatch.protogen` rewrites hangwatch/_proto; a test regenerates
into a temp dir and fails when the committed files are stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTO_FILES = ("hangwatch/v1/hangwatch.proto",)


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # test/dev dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    for rel in PROTO_FILES:
        rc = protoc.main(
            [
                "protoc",
                f"-I{PROTO_DIR}",
                f"--python_out={out_dir}",
                f"--pyi_out={out_dir}",
                f"--grpc_python_out={out_dir}",
                str(PROTO_DIR / rel),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed on {rel} (rc={rc})")
    written = sorted(p for p in out_dir.rglob("*") if p.is_file())
    # protoc emits absolute `from hangwatch.v1 import` imports; make them
    # relative to our package so the stubs live under hangwatch._proto.
    for p in written:
        if p.name.endswith("_grpc.py"):
            text = p.read_text()
            text = re.sub(r"^from hangwatch\.v1 import", "from . import", text, flags=re.M)
            p.write_text(text)
    for d in [out_dir / "hangwatch", out_dir / "hangwatch" / "v1"]:
        (d / "__init__.py").touch()
    return written


if __name__ == "__main__":
    generate(ROOT / "hangwatch" / "_proto")
    sys.exit(0)
