"""Tails decoded on the node (hangwatch.analyzer.packed) load exactly as the
tails decoded by the analyzer, and a columns member that is stale, damaged or
from another decoder costs only time: the tails are decoded instead."""

from __future__ import annotations

import json
import random
import re
import shutil
import struct
from pathlib import Path

import pandas as pd
import pytest
from hangwatch.agent.uploader import node_columns, start_decoder, stop_decoder
from hangwatch.analyzer import packed
from hangwatch.analyzer.discovery import discover
from hangwatch.analyzer.loader import LoadedDumps, load_dumps
from hangwatch.analyzer.reading import read_packed
from helpers import GOLDEN_DIR, conformance_incident

from hangwatch import formats, frtail
from hangwatch.formats import nodearchive

GOLDEN_DIRS = sorted(p for p in GOLDEN_DIR.iterdir() if (p / "manifest.json").is_file())

pytestmark = pytest.mark.timeout(120)


def _archive(
    src: Path, dst: Path, *, per_node: int = 2, columns: bool = True, tails: bool = False
) -> None:
    """`src`'s rank directories as node archives in `dst`, `per_node` ranks
    each, with their dumps decoded into a columns member as an agent adds it.
    `tails`: each FR dump replaced by its tail, as phase one sends it."""
    dst.mkdir(parents=True)
    # A rank's files: its directory, or (flat sets) the dumps named after it.
    per_rank: dict[int, list[Path]] = {}
    for f in sorted(src.iterdir()):
        m = re.fullmatch(r"rank_(\d+)", f.name) if f.is_dir() else None
        if m is not None:
            per_rank[int(m.group(1))] = sorted(f.iterdir())
            continue
        m = re.fullmatch(r".*rank_(\d+)", f.name)
        if m is not None:
            per_rank.setdefault(int(m.group(1)), []).append(f)
        else:
            shutil.copy(f, dst / f.name)
    ranks = sorted(per_rank)
    (dst / nodearchive.NODES_DIR).mkdir()
    for i in range(0, len(ranks), per_node):
        node = ranks[i : i + per_node]
        members: list[tuple[int, str, bytes]] = []
        dumps: list[tuple[int, str, bytes]] = []
        for r in node:
            for f in per_rank[r]:
                data = f.read_bytes()
                if f.name in (formats.META_FILE, formats.STACKS_FILE):
                    members.append((r, f.name, data))
                    continue
                name = f.name
                if tails:
                    cut = frtail.tail_bytes(data, context=2)
                    data = data if cut is None else cut
                    name = formats.tail_name_for(f.name)
                members.append((r, name, data))
                dumps.append((r, name, data))
        if columns:
            cols = packed.pack(dumps)
            assert cols is not None
            members.append((node[0], formats.FR_COLUMNS_FILE, cols))
        (dst / nodearchive.NODES_DIR / nodearchive.archive_name(node[0])).write_bytes(
            nodearchive.build(members)
        )


def _assert_same_load(a: LoadedDumps, b: LoadedDumps) -> None:
    pd.testing.assert_frame_equal(a.entries, b.entries)
    for k in (
        "pg_status",
        "ranks_loaded",
        "frames",
        "versions",
        "comm_lib_versions",
        "backends",
        "pg_config",
        "unmapped_pg_ids",
        "files",
        "complete_ranks",
        "tail_ranks",
        "completion_unknown_groups",
    ):
        assert getattr(a, k) == getattr(b, k), k
    assert {n: g.ranks for n, g in a.groups.items()} == {n: g.ranks for n, g in b.groups.items()}


def _columns_member(bundle: Path, first: int) -> tuple[Path, bytes]:
    path = bundle / nodearchive.NODES_DIR / nodearchive.archive_name(first)
    data = nodearchive.stored_file(bundle, first, formats.FR_COLUMNS_FILE)
    assert data is not None
    return path, data


def _replace_member(path: Path, name: str, data: bytes) -> None:
    z = path.read_bytes()
    files = [
        (m.rank, m.name, data if m.member == name else nodearchive.read_bytes(z, m))
        for m in nodearchive.check(z, None)
    ]
    path.write_bytes(nodearchive.build(files))


@pytest.mark.parametrize("tails", [False, True], ids=["whole", "tails"])
@pytest.mark.parametrize("src", GOLDEN_DIRS, ids=[p.name for p in GOLDEN_DIRS])
def test_columns_load_exactly_as_the_dumps_decoded_here(
    src: Path, tails: bool, tmp_path: Path
) -> None:
    _archive(src, tmp_path / "cols", tails=tails)
    _archive(src, tmp_path / "plain", tails=tails, columns=False)
    # Every dump was taken from the columns, none decoded here.
    found = discover(tmp_path / "cols", None)
    done, errors = read_packed(found.dumps, found.columns, max_bytes=1 << 30, max_entries=1 << 20)
    assert not errors and sorted(done) == list(range(len(found.dumps)))
    _assert_same_load(load_dumps(tmp_path / "cols"), load_dumps(tmp_path / "plain"))


def test_real_nccl_tails_round_trip(tmp_path: Path) -> None:
    """A real 16-GPU NCCL incident's dumps, cut to tails as the agent cuts
    them and decoded on 'nodes' of 8, load as the analyzer decodes them."""
    inc = conformance_incident("lock_gil_1st")
    for cols in (True, False):
        root = tmp_path / ("cols" if cols else "plain")
        (root / nodearchive.NODES_DIR).mkdir(parents=True)
        for first in (0, 8):
            members = []
            for r in range(first, first + 8):
                data = (inc / f"_dump_{r}").read_bytes()
                cut = frtail.tail_bytes(data, max_members=frtail.AGENT_MAX_MEMBERS)
                members.append((r, f"{formats.FR_TAIL_PREFIX}{r}", cut or data))
            if cols:
                got = packed.pack(members)
                assert got is not None
                members.append((first, formats.FR_COLUMNS_FILE, got))
            (root / nodearchive.NODES_DIR / nodearchive.archive_name(first)).write_bytes(
                nodearchive.build(members)
            )
    a, b = load_dumps(tmp_path / "cols"), load_dumps(tmp_path / "plain")
    assert len(a.entries) and a.ranks_loaded == list(range(16))
    _assert_same_load(a, b)


def test_a_tail_changed_since_its_columns_is_decoded_from_the_tail(tmp_path: Path) -> None:
    """The columns of rank 1 were built from an older tail: the archive's own
    tail counts, and the other rank still comes from the columns."""
    src = GOLDEN_DIR / "compute"
    _archive(src, tmp_path / "b", tails=True)
    path = tmp_path / "b" / nodearchive.NODES_DIR / nodearchive.archive_name(0)
    name = f"rank_1/{formats.tail_name_for(formats.FR_FILE_PREFIX + '1')}"
    whole = (src / "rank_1" / f"{formats.FR_FILE_PREFIX}1").read_bytes()
    newer = frtail.tail_bytes(whole, context=4)
    assert newer is not None
    _replace_member(path, name, newer)
    found = discover(tmp_path / "b", None)
    done, errors = read_packed(found.dumps, found.columns, max_bytes=1 << 30, max_entries=1 << 20)
    assert not errors
    assert sorted(found.dumps[i].rel.split("!")[1] for i in done) == sorted(
        c.rel.split("!")[1] for c in found.dumps if c.rel.split("!")[1] != name
    )
    plain = tmp_path / "plain"
    shutil.copytree(tmp_path / "b", plain)
    for p in nodearchive.archives(plain):
        z = p.read_bytes()
        p.write_bytes(
            nodearchive.build(
                [
                    (m.rank, m.name, nodearchive.read_bytes(z, m))
                    for m in nodearchive.check(z, None)
                    if m.name != formats.FR_COLUMNS_FILE
                ]
            )
        )
    _assert_same_load(load_dumps(tmp_path / "b"), load_dumps(plain))


def _damaged(data: bytes) -> dict[str, bytes]:
    hlen = struct.unpack_from("<I", data, len(packed.MAGIC))[0]
    start = len(packed.MAGIC) + 4
    head = json.loads(data[start : start + hlen])

    def with_head(h: dict[str, object]) -> bytes:
        raw = json.dumps(h).encode()
        return data[: len(packed.MAGIC)] + struct.pack("<I", len(raw)) + raw + data[start + hlen :]

    wrong_values = json.loads(json.dumps(head))
    wrong_values["values"][0] = wrong_values["values"][0][:-1]  # a code now points past it
    dup = json.loads(json.dumps(head))
    dup["dumps"][0]["values"][0] = len(dup["values"]) + 5
    return {
        "cut short": data[:-3],
        "not a columns member": b"PK" + data,
        "header not JSON": data[: start + 2] + b"\xff" + data[start + 3 :],
        "a value list missing its last value": with_head(wrong_values),
        "an index past its table": with_head(dup),
        "rows without their arrays": with_head(
            {**head, "dumps": [{**head["dumps"][0], "n": head["dumps"][0]["n"] + 1}]}
        ),
    }


@pytest.mark.parametrize(
    "how",
    [
        "cut short",
        "not a columns member",
        "header not JSON",
        "a value list missing its last value",
        "an index past its table",
        "rows without their arrays",
    ],
)
def test_a_damaged_columns_member_is_one_error_and_the_tails_decode(
    how: str, tmp_path: Path
) -> None:
    src = GOLDEN_DIR / "compute"
    _archive(src, tmp_path / "b", tails=True)
    _archive(src, tmp_path / "plain", tails=True, columns=False)
    path, data = _columns_member(tmp_path / "b", 0)
    _replace_member(path, f"rank_0/{formats.FR_COLUMNS_FILE}", _damaged(data)[how])
    loaded = load_dumps(tmp_path / "b")
    assert [e.file for e in loaded.errors] == [f"nodes/node_0.zip!rank_0/{formats.FR_COLUMNS_FILE}"]
    assert loaded.errors[0].error.endswith("its tails were decoded instead"), loaded.errors
    plain = load_dumps(tmp_path / "plain")
    loaded.errors = plain.errors
    _assert_same_load(loaded, plain)


def test_columns_of_another_decoder_are_passed_over_quietly(tmp_path: Path) -> None:
    src = GOLDEN_DIR / "compute"
    _archive(src, tmp_path / "b", tails=True)
    _archive(src, tmp_path / "plain", tails=True, columns=False)
    for first in (0, 2):
        path, data = _columns_member(tmp_path / "b", first)
        hlen = struct.unpack_from("<I", data, len(packed.MAGIC))[0]
        start = len(packed.MAGIC) + 4
        head = json.loads(data[start : start + hlen])
        assert head["decoder"] == packed.decoder_id()
        head["decoder"] = "0" * len(head["decoder"])
        raw = json.dumps(head).encode()
        _replace_member(
            path,
            f"rank_{first}/{formats.FR_COLUMNS_FILE}",
            data[: len(packed.MAGIC)] + struct.pack("<I", len(raw)) + raw + data[start + hlen :],
        )
    found = discover(tmp_path / "b", None)
    done, errors = read_packed(found.dumps, found.columns, max_bytes=1 << 30, max_entries=1 << 20)
    assert not done and not errors
    _assert_same_load(load_dumps(tmp_path / "b"), load_dumps(tmp_path / "plain"))


def test_no_mutation_of_a_columns_member_escapes_as_anything_but_pack_error(
    tmp_path: Path,
) -> None:
    """Bytes changed anywhere (header or arrays): unpack either refuses with a
    PackError or returns dumps; no other exception reaches the loader."""
    src = GOLDEN_DIR / "p2p"
    _archive(src, tmp_path / "b", tails=True, per_node=8)
    path, data = _columns_member(tmp_path / "b", 0)
    members = {m.member: m for m in nodearchive.list_members(path)}
    assert len(packed.unpack(data, members)) == len(list(src.glob("rank_*")))
    rng = random.Random(20261203)
    refused = 0
    for _ in range(400):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        try:
            packed.unpack(bytes(buf), members)
        except packed.PackError:
            refused += 1
    assert refused > 0


def test_the_agents_child_process_decodes_a_nodes_tails(tmp_path: Path) -> None:
    """agent.uploader.node_columns runs the decoder in a child process (the
    sidecar never loads numpy): its member is what pack gives in process; a
    tail that is not a dump is left out; no tail at all gives nothing."""
    src = GOLDEN_DIR / "compute"
    files: list[tuple[str, int]] = []
    tails: list[tuple[int, str, bytes]] = []
    for r in (0, 1):
        cut = frtail.tail_bytes((src / f"rank_{r}" / f"{formats.FR_FILE_PREFIX}{r}").read_bytes())
        assert cut is not None
        p = tmp_path / f"rank_{r}" / f"{formats.FR_TAIL_PREFIX}{r}"
        p.parent.mkdir()
        p.write_bytes(cut)
        files.append((str(p), r))
        tails.append((r, p.name, cut))
        meta = p.parent / formats.META_FILE
        shutil.copy(src / f"rank_{r}" / formats.META_FILE, meta)
        files.append((str(meta), r))
    bad = tmp_path / "rank_2" / f"{formats.FR_TAIL_PREFIX}2"
    bad.parent.mkdir()
    bad.write_bytes(b"not a dump at all")
    assert node_columns(files) == packed.pack(tails)
    assert node_columns([*files, (str(bad), 2)]) == packed.pack(tails)
    assert node_columns([(str(tmp_path / "gone" / f"{formats.FR_TAIL_PREFIX}5"), 5)]) is None
    # Started ahead (at the DUMP command, as the agent does), then fed.
    ahead = start_decoder()
    assert ahead is not None
    assert node_columns(files, ahead) == packed.pack(tails)
    assert ahead.returncode == 0
    # Not needed after all (no tail to decode): the child is stopped, not left waiting.
    unused = start_decoder()
    assert unused is not None
    assert node_columns([f for f in files if f[0].endswith(formats.META_FILE)], unused) is None
    assert unused.returncode is not None
    idle = start_decoder()
    assert idle is not None
    stop_decoder(idle)
    assert idle.returncode is not None
