"""The simulated job's fixed numbers: node size, versions, wire limits, the step program."""

from __future__ import annotations

from typing import Final

import grpc

RANKS_PER_AGENT: Final = 8
FR_VERSION: Final = "2.10"
NCCL_VERSION: Final = "2.27.3"
TORCH_VERSION: Final = "2.13.0"
# Same ceiling as the real agent's uploader (one chunk per ~0.75 MB dump).
CHUNK_BYTES: Final = 1 << 20
# The job ran this many steps before the run starts, so record ids and
# sequence numbers are as large as in a long-running job.
START_STEP: Final = 17_000
UNARY_TIMEOUT_S: Final = 30.0
UPLOAD_TIMEOUT_S: Final = 120.0
# Worth retrying (with back-off) rather than counting as an answer.
TRANSIENT: Final = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
)
COMPLETE_ATTEMPTS: Final = 5  # CompleteDump tries, 0.5-4 s apart
# The poll grid the agents read their ranks on (hangwatch.pollgrid): the
# coordinator's default --poll-interval, its straggler monitor's tick.
POLL_TICK_S: Final = 1.0
# What a simulated agent's clock exchange with a coordinator on the same host
# would bound its error to: its reports are filed for the straggler monitor,
# as a synced real agent's are (RankProgress.status_at_ns on the grid).
SIM_CLOCK_ERROR_NS: Final = 500_000

KINDS: Final = ("default", "tp", "pp", "dp")
PG_ID: Final = {"default": 0, "tp": 1, "pp": 2, "dp": 3}  # creation order on every rank
DESC: Final = {
    "default": "default_pg",
    "tp": "TENSOR_MODEL_PARALLEL_GROUP",
    "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
    "dp": "DATA_PARALLEL_GROUP",
}
# One training step. Pipeline stages exchange activations with send/recv,
# which FR does not count in collective_seq_id; the PP group's collective is
# the cross-stage grad-norm all-reduce.
STEP: Final[tuple[tuple[str, str], ...]] = (
    ("tp", "_all_gather_base"),
    ("tp", "_reduce_scatter_base"),
    ("tp", "_all_gather_base"),  # the hang position: a TP op inside a node
    ("tp", "_reduce_scatter_base"),
    ("pp", "all_reduce"),
    ("dp", "_reduce_scatter_base"),
    ("dp", "_all_gather_base"),
    ("default", "all_reduce"),
)
OPS_PER_STEP: Final = len(STEP)
HANG_POS: Final = 2
assert STEP[HANG_POS][0] == "tp"
