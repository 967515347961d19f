"""Hostile and broken input: a clean error or a valid result, never an escape."""

from __future__ import annotations

import json
import pickle
import tempfile
from pathlib import Path

import pytest
from fr_dumps import SimJob
from hangwatch.analyzer import analyze, load_dumps
from hangwatch.analyzer.parse import parse_dump_bytes
from hangwatch.analyzer.sniff import DumpFormatError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# test_bit_flips analyses 100 damaged copies of a bundle: about 60 s on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(180)

_JOB = SimJob(2)
_JOB.all("0")
_JOB.ranks[0].p2p("0", "send", 1)
GOOD_PICKLE = _JOB.ranks[0].dump_bytes()
GOOD_JSON = _JOB.ranks[0].dump_bytes(json_form=True)

FUZZ = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _parse_ok_or_clean(data: bytes) -> None:
    try:
        d = parse_dump_bytes(data)
    except DumpFormatError as e:
        assert str(e) and "\n" not in str(e)
    else:
        assert isinstance(d["entries"], list)


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes(data: bytes) -> None:
    _parse_ok_or_clean(data)


@FUZZ
@given(st.integers(0, len(GOOD_PICKLE)), st.sampled_from([GOOD_PICKLE, GOOD_JSON]))
def test_truncated(n: int, good: bytes) -> None:
    _parse_ok_or_clean(good[:n])


@FUZZ
@given(
    st.lists(
        st.tuples(st.integers(0, len(GOOD_PICKLE) - 1), st.integers(0, 7)), min_size=1, max_size=8
    )
)
def test_bit_flips(flips: list[tuple[int, int]]) -> None:
    for good in (GOOD_PICKLE, GOOD_JSON):
        b = bytearray(good)
        for pos, bit in flips:
            b[pos % len(b)] ^= 1 << bit
        _parse_ok_or_clean(bytes(b))


HOSTILE = [
    b"\x80\x04c" + b"os\nsystem\n" + b"\x94.",  # GLOBAL
    b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93\x8c\x04true\x85R.",  # STACK_GLOBAL + REDUCE
    b"(S'true'\nios\nsystem\n.",  # INST
    b"(cos\nsystem\nS'true'\no.",  # OBJ
    b"\x80\x02cbuiltins\neval\nq\x00X\x04\x00\x00\x001+1q\x01\x85q\x02Rq\x03.",
    b"\x80\x04" + b"(" * 100000 + b".",  # deep MARK nesting
    b"\x80\x04" + b"]" * 200000 + b".",  # huge stack
    b"\x80\x04P0\n.",  # persistent id
    b"[" * 100000 + b"]" * 100000,  # deeply nested JSON
]


@pytest.mark.parametrize("data", HOSTILE)
def test_hostile_pickles_and_json(data: bytes, tmp_path: Path) -> None:
    with pytest.raises(DumpFormatError):
        parse_dump_bytes(data)
    (tmp_path / "x_0").write_bytes(data)
    loaded = load_dumps(tmp_path)
    assert loaded.ranks_loaded == [] and len(loaded.errors) == 1


_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=4), st.floats(allow_nan=False)
)
_json = st.recursive(
    _scalar,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=12,
)
_FIELDS = [
    "collective_seq_id",
    "p2p_seq_id",
    "record_id",
    "pg_id",
    "process_group",
    "profiling_name",
    "input_sizes",
    "output_sizes",
    "input_dtypes",
    "state",
    "retired",
    "is_p2p",
    "frames",
    "time_created_ns",
    "timeout_ms",
    "thread_name",
]


@settings(FUZZ, max_examples=40)
@given(
    changes=st.lists(st.tuples(st.sampled_from(_FIELDS), _json), min_size=1, max_size=4),
    as_json=st.booleans(),
)
def test_wrong_types_in_fields_never_escape(
    changes: list[tuple[str, object]], as_json: bool, tmp_path: Path
) -> None:
    obj = _JOB.ranks[0].dump_obj(json_form=as_json)
    for k, v in changes:
        obj["entries"][0][k] = v
    data = json.dumps(obj).encode() if as_json else pickle.dumps(obj)
    _parse_ok_or_clean(data)
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    (d / "nccl_trace_rank_0").write_bytes(data)
    (d / "nccl_trace_rank_1").write_bytes(_JOB.ranks[1].dump_bytes())
    loaded = load_dumps(d)
    assert 1 in loaded.ranks_loaded
    assert loaded.ranks_loaded == [0, 1] or [e.file for e in loaded.errors] == ["nccl_trace_rank_0"]
    analyze(loaded)  # whatever loaded must also diagnose


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["version", "entries", "pg_status", "pg_config", "comm_lib_version"]), _json
    )
)
def test_random_top_level_json(doc: dict) -> None:
    _parse_ok_or_clean(json.dumps(doc).encode())
