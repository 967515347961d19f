"""Bundles whose phase one arrived as node archives (`<bundle>/nodes/node_<R>.zip`,
hangwatch.formats.nodearchive) read exactly as the same files in rank
directories, and a damaged archive costs only what it holds."""

from __future__ import annotations

import dataclasses
import os
import shutil
import zipfile
from pathlib import Path

import pytest
from hangwatch.analyzer import analyze_path
from hangwatch.analyzer.report import Report
from helpers import GOLDEN_DIR

from hangwatch import formats
from hangwatch.formats import RankMeta, nodearchive

GOLDEN_DIRS = sorted(p for p in GOLDEN_DIR.iterdir() if (p / "manifest.json").is_file())

pytestmark = pytest.mark.timeout(120)


def _pack(src: Path, dst: Path, per_node: int = 2) -> None:
    """`src` copied to `dst` with its rank directories packed, `per_node` ranks
    an archive, by the agent's own builder."""
    shutil.copytree(src, dst)
    ranks = sorted(int(p.name[5:]) for p in dst.glob("rank_*"))
    (dst / nodearchive.NODES_DIR).mkdir()
    for i in range(0, len(ranks), per_node):
        node = ranks[i : i + per_node]
        members = [
            (r, f.name, f.read_bytes()) for r in node for f in sorted((dst / f"rank_{r}").iterdir())
        ]
        (dst / nodearchive.NODES_DIR / nodearchive.archive_name(node[0])).write_bytes(
            nodearchive.build(members)
        )
        for r in node:
            shutil.rmtree(dst / f"rank_{r}")


def _comparable(rep: Report) -> str:
    # Everything the report says, file names aside (they name the archive).
    doc = rep.to_dict()
    doc.pop("files", None)
    return str(doc)


@pytest.mark.parametrize("src", GOLDEN_DIRS, ids=[p.name for p in GOLDEN_DIRS])
def test_a_packed_bundle_gives_the_same_report(src: Path, tmp_path: Path) -> None:
    _pack(src, tmp_path / "packed")
    assert not list((tmp_path / "packed").glob("rank_*"))
    loose, packed = analyze_path(src), analyze_path(tmp_path / "packed")
    assert packed.errors == loose.errors
    assert _comparable(packed) == _comparable(loose)


def test_a_damaged_archive_costs_only_its_own_ranks(tmp_path: Path) -> None:
    src = GOLDEN_DIR / "compute"
    _pack(src, tmp_path / "b")
    nodes = nodearchive.archives(tmp_path / "b")
    assert len(nodes) == 2
    nodes[1].write_bytes(nodes[1].read_bytes()[:100])  # cut off mid-transfer
    rep = analyze_path(tmp_path / "b")
    assert rep.ranks_loaded == [0, 1]
    assert [e.file for e in rep.errors] == ["nodes/node_2.zip"], rep.errors
    assert "not a readable zip archive" in rep.errors[0].error
    assert rep.verdict != "healthy"


def test_a_corrupt_member_is_one_file_error(tmp_path: Path) -> None:
    src = GOLDEN_DIR / "compute"
    _pack(src, tmp_path / "b")
    path = nodearchive.archives(tmp_path / "b")[0]
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(f"rank_1/{formats.FR_FILE_PREFIX}1")
    data = bytearray(path.read_bytes())
    # Flip bytes inside the member's compressed data: its CRC no longer holds.
    start = info.header_offset + 30 + len(info.filename) + 10
    data[start : start + 8] = bytes(b ^ 0xFF for b in data[start : start + 8])
    path.write_bytes(bytes(data))
    rep = analyze_path(tmp_path / "b")
    assert [e.file for e in rep.errors] == [f"nodes/node_0.zip!rank_1/{formats.FR_FILE_PREFIX}1"]
    assert 1 not in rep.ranks_loaded and {0, 2, 3} <= set(rep.ranks_loaded)
    assert rep.verdict != "healthy"


def test_a_ranks_own_meta_beats_the_coordinators_stand_in(tmp_path: Path) -> None:
    """Rank 3's agent was late: the coordinator wrote a stand-in meta.json in
    rank_3/, then the node's archive arrived with the rank's own."""
    src = GOLDEN_DIR / "compute"
    _pack(src, tmp_path / "b")
    stand_in = RankMeta(rank=3, process_state="unknown").replace(
        reachable=False,
        sources={"process": "coordinator"},
        errors={"fr": "agent unreachable"},
    )
    assert stand_in.stand_in
    (tmp_path / "b" / "rank_3").mkdir()
    (tmp_path / "b" / "rank_3" / formats.META_FILE).write_bytes(stand_in.to_bytes())
    rep = analyze_path(tmp_path / "b")
    assert rep.evidence[3].reachable is not False
    assert _comparable(rep) == _comparable(analyze_path(src))


def test_members_read_back_byte_for_byte_and_damage_is_refused(tmp_path: Path) -> None:
    """`read` gives each member's bytes as built, keeping the archive open
    between members; a cut archive, or bytes past the caller's limit, are
    each an ArchiveError, never wrong bytes."""
    files = [(r, name, os.urandom(64) * (r + 1) * 50) for r in range(4) for name in ("a", "b.txt")]
    path = tmp_path / nodearchive.archive_name(0)
    path.write_bytes(nodearchive.build(files))
    members = nodearchive.list_members(path)
    try:
        with zipfile.ZipFile(path) as z:
            for m in members:
                assert nodearchive.read(m, nodearchive.MAX_MEMBER_BYTES) == z.read(m.member)
        big = max(members, key=lambda m: m.size)
        with pytest.raises(nodearchive.ArchiveError, match="over the 100-byte limit"):
            nodearchive.read(big, 100)
    finally:
        nodearchive.release()
    cut = tmp_path / nodearchive.archive_name(8)
    with zipfile.ZipFile(path) as z:
        last_at = z.infolist()[-1].header_offset
    cut.write_bytes(path.read_bytes()[: last_at + 40])
    last = dataclasses.replace(members[-1], archive=str(cut))
    try:
        with pytest.raises(nodearchive.ArchiveError, match="cannot read"):
            nodearchive.read(last, nodearchive.MAX_MEMBER_BYTES)
    finally:
        nodearchive.release()


def test_members_are_read_at_their_offset_and_a_bad_local_header_is_refused(
    tmp_path: Path,
) -> None:
    """`read` goes to a member's local header from the central directory's
    offset: stored members and members with an extra field read back exactly
    (what zipfile gives), and a damaged local header is an ArchiveError."""
    path = tmp_path / nodearchive.archive_name(0)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(zipfile.ZipInfo("rank_0/stored"), b"plain bytes" * 100)  # ZIP_STORED
        info = zipfile.ZipInfo("rank_0/deflated")
        info.compress_type = zipfile.ZIP_DEFLATED
        info.extra = b"\xfe\xca\x04\x00abcd"  # an extra field in the local header
        z.writestr(info, os.urandom(64) * 40)
    members = {m.name: m for m in nodearchive.list_members(path)}
    assert members["stored"].offset >= 0 and members["deflated"].offset >= 0
    try:
        with zipfile.ZipFile(path) as z:
            for m in members.values():
                assert nodearchive.read(m, nodearchive.MAX_MEMBER_BYTES) == z.read(m.member)
    finally:
        nodearchive.release()
    data = bytearray(path.read_bytes())
    at = members["deflated"].offset
    data[at : at + 4] = b"PK\x09\x09"
    path.write_bytes(bytes(data))
    try:
        with pytest.raises(nodearchive.ArchiveError, match="cannot read: bad magic"):
            nodearchive.read(members["deflated"], nodearchive.MAX_MEMBER_BYTES)
        # The other member is untouched and still reads.
        assert nodearchive.read(members["stored"], 1 << 20) == b"plain bytes" * 100
    finally:
        nodearchive.release()
