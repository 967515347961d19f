"""The agent keeps its newest incident bundles and deletes the rest."""

from __future__ import annotations

import os
from pathlib import Path

from hangwatch.agent.collector import prune_bundles

from hangwatch import formats


def _bundle(run: Path, name: str, age_s: float) -> Path:
    d = run / formats.BUNDLES_DIR / name / "rank_0"
    d.mkdir(parents=True)
    (d / "fr_trace_rank_0").write_bytes(b"x" * 100)
    t = 1_700_000_000 - age_s
    os.utime(d.parent, (t, t))
    return d.parent


def test_keeps_the_newest_and_every_protected_bundle(tmp_path: Path) -> None:
    for i in range(5):
        _bundle(tmp_path, f"inc{i}", age_s=100 * i)  # inc0 newest
    gone = prune_bundles(str(tmp_path), keep=2, protect={"inc4"})
    assert sorted(gone) == ["inc2", "inc3"]
    left = sorted(p.name for p in (tmp_path / formats.BUNDLES_DIR).iterdir())
    assert left == ["inc0", "inc1", "inc4"]


def test_no_bundles_dir_and_symlinks_are_left_alone(tmp_path: Path) -> None:
    assert prune_bundles(str(tmp_path), keep=0, protect=set()) == []
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    root = tmp_path / formats.BUNDLES_DIR
    root.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    _bundle(tmp_path, "old", age_s=10)
    assert prune_bundles(str(tmp_path), keep=0, protect=set()) == ["old"]
    assert (outside / "precious").read_text() == "keep me"
