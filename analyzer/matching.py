"""Cross-rank consistency of one collective (same group, same collective seq).

The rules follow torch's flight-recorder matcher (`Op.match`/`dtype_mismatch`
in torch.distributed.flight_recorder.components.types), applied to whole
columns at once:

* op type must agree;
* input sizes must agree except for all_to_all and scatter; output sizes
  except for all_to_all and gather; all_reduce's input equals its output;
* all_gather family: output numel == input numel x group size;
  reduce_scatter family: input numel == output numel x group size (we apply
  this to the `_base`/`_into_tensor` spellings too, which torch's string
  match misses, and only when membership is authoritative);
* dtypes compared as sets: per rank input vs output (not for scatter, gather,
  broadcast), and across ranks for inputs (not scatter, broadcast) and outputs
  (not gather);
* all_to_all sizes are undecidable per rank: never a mismatch;
* coalesced ops (several entries sharing one seq, closed by `coalesced`) are
  compared by op type only.

State differences (one rank completed, another still scheduled) are normal
while NCCL work is in flight; they are reported, never blamed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from hangwatch.analyzer.groups import GroupMeta
from hangwatch.analyzer.report import FindingKind

ALL_TO_ALL = frozenset({"all_to_all", "alltoall", "alltoall_base", "all_to_all_single"})
ALL_GATHER = frozenset(
    {
        "all_gather",
        "_all_gather_base",
        "all_gather_base",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "allgather",
        "allgather_into_tensor_coalesced",
    }
)
REDUCE_SCATTER = frozenset(
    {
        "reduce_scatter",
        "_reduce_scatter_base",
        "reduce_scatter_base",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
    }
)
ALL_REDUCE = frozenset({"all_reduce", "allreduce", "allreduce_coalesced", "all_reduce_coalesced"})
COALESCED_MARK = "coalesced"


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    kind: str  # FindingKind.OP_MISMATCH | SIZE_MISMATCH | DTYPE_MISMATCH
    group: str
    seq: int
    odd_ranks: list[int]  # the ranks out of line (minority), or all when no majority
    ranks: list[int]  # every rank that has the collective
    detail: str


# The columns the consistency rules read; representatives carries only these.
_REP_COLUMNS = (
    "rank",
    "group",
    "collective_seq_id",
    "record_id",
    "op",
    "input_sizes",
    "output_sizes",
    "input_dtypes",
    "output_dtypes",
    "in_numel",
    "out_numel",
)


def representatives(entries: pd.DataFrame) -> pd.DataFrame:
    """One row per (rank, group, collective seq): the entry that closes it.

    A coalesced op records one entry per member op sharing the seq, then the
    closing `coalesced` entry; the closing (newest) one stands for all.
    Row selection is done on integer arrays and only the rule columns are
    gathered, so millions of entries cost one sort and a few takes.
    """
    rows = np.flatnonzero(~entries["is_p2p"].to_numpy())
    if not len(rows):
        return entries.iloc[:0][list(_REP_COLUMNS)].assign(n_sub=np.zeros(0, dtype=np.int64))
    rank = entries["rank"].to_numpy()[rows]
    g = entries["group"].cat.codes.to_numpy()[rows]
    seq = entries["collective_seq_id"].to_numpy()[rows]
    rec = entries["record_id"].to_numpy()[rows]
    order = np.lexsort((rec, seq, g, rank))
    r_o, g_o, s_o = rank[order], g[order], seq[order]
    # The last row of each (rank, group, seq) run closes it.
    last = np.ones(len(order), dtype=bool)
    last[:-1] = (r_o[1:] != r_o[:-1]) | (g_o[1:] != g_o[:-1]) | (s_o[1:] != s_o[:-1])
    first = np.ones(len(order), dtype=bool)
    first[1:] = last[:-1]
    starts = np.flatnonzero(first)
    ends = np.flatnonzero(last)
    pick = rows[order[ends]]
    rep = pd.DataFrame(
        {c: entries[c].array.take(pick) for c in _REP_COLUMNS}, index=entries.index[pick]
    )
    return rep.assign(n_sub=(ends - starts + 1))


def _dtype_set(col: pd.Series) -> pd.Series:
    # "Float,Float,BFloat16" -> "BFloat16,Float": torch compares dtype *sets*.
    s = col.astype(str)
    norm = {u: ",".join(sorted({x for x in u.split(",") if x})) for u in pd.unique(s)}
    return s.map(norm)


def _odd_ones(values: pd.Series, ranks: pd.Series) -> list[int]:
    counts = values.value_counts()
    if len(counts) > 1 and counts.iloc[0] > counts.iloc[1]:
        mode = counts.index[0]
        return sorted(int(r) for r in ranks[values != mode])
    return sorted(int(r) for r in ranks)


def _suspects(rep: pd.DataFrame, groups: dict[str, GroupMeta]) -> np.ndarray:
    """Rows of (group, seq) keys that might break a rule, found on integer
    codes only; the exact (slower) checks then run on these rows alone. At a
    million entries almost every key is consistent and is dropped here."""
    n = len(rep)
    gcode = rep["group"].cat.codes.to_numpy().astype(np.int64)
    seq = rep["collective_seq_id"].to_numpy()
    kid = gcode * (int(seq.max()) + 2 if n else 1) + (seq + 1)
    # One sort by key; per-key min/max of each column then come from reduceat.
    order = np.argsort(kid, kind="stable")
    ks = kid[order]
    head = np.ones(n, dtype=bool)
    head[1:] = ks[1:] != ks[:-1]
    starts = np.flatnonzero(head)
    inv = np.empty(n, dtype=np.int64)
    inv[order] = np.cumsum(head) - 1
    counts = np.diff(np.append(starts, n))
    multi = counts[inv] > 1
    ops = (
        rep["op"].astype(str) if not isinstance(rep["op"].dtype, pd.CategoricalDtype) else rep["op"]
    )
    op_cats = np.asarray(ops.cat.categories, dtype=object)
    op_code = ops.cat.codes.to_numpy()
    a2a = np.isin(op_cats, list(ALL_TO_ALL))[op_code]
    bad = np.zeros(n, dtype=bool)
    for col in ("op", "input_sizes", "output_sizes", "input_dtypes", "output_dtypes"):
        c = rep[col].cat.codes.to_numpy().astype(np.int64)
        if col.endswith("_sizes"):
            c = np.where(a2a, -1, c)
        cs = c[order]
        diff = np.minimum.reduceat(cs, starts) != np.maximum.reduceat(cs, starts)
        bad |= diff[inv]
    # Per-row rules, decided once per distinct (op, sizes/dtypes) combination.
    per_row_ops = {
        "input_sizes": np.isin(op_cats, list(ALL_REDUCE))[op_code],
        "input_dtypes": ~np.isin(op_cats, ["scatter", "gather", "broadcast"])[op_code],
    }
    for a, b in (("input_sizes", "output_sizes"), ("input_dtypes", "output_dtypes")):
        ca = rep[a].cat.codes.to_numpy().astype(np.int64)
        cb = rep[b].cat.codes.to_numpy().astype(np.int64)
        cats_a = np.asarray(rep[a].cat.categories, dtype=object)
        cats_b = np.asarray(rep[b].cat.categories, dtype=object)
        width = len(cats_b) + 1
        upair, pinv = np.unique(ca * width + cb, return_inverse=True)
        differs = np.array(
            [
                0 <= u // width < len(cats_a)
                and 0 <= u % width < len(cats_b)
                and cats_a[u // width] != cats_b[u % width]
                for u in upair
            ],
            dtype=bool,
        )
        bad |= differs[pinv] & per_row_ops[a]
    gnames = np.asarray(rep["group"].cat.categories, dtype=object)
    gsize_by_code = np.array(
        [
            len(groups[g].ranks) if g in groups and groups[g].membership_source != "dumps" else -1
            for g in gnames
        ],
        dtype=np.int64,
    )
    gs = gsize_by_code[gcode] if len(gsize_by_code) else np.full(n, -1)
    in_n = rep["in_numel"].to_numpy()
    out_n = rep["out_numel"].to_numpy()
    ag = np.isin(op_cats, list(ALL_GATHER))[op_code] & (gs > 0) & (in_n >= 0) & (out_n >= 0)
    rs = np.isin(op_cats, list(REDUCE_SCATTER))[op_code] & (gs > 0) & (in_n >= 0) & (out_n >= 0)
    bad |= ag & (out_n != in_n * gs)
    bad |= rs & (in_n != out_n * gs)
    bad_key = np.logical_or.reduceat(bad[order], starts)
    return multi & bad_key[inv]


def find_mismatches(entries: pd.DataFrame, groups: dict[str, GroupMeta]) -> list[Mismatch]:
    rep = representatives(entries)
    if not len(rep):
        return []
    rep = rep.loc[_suspects(rep, groups)]
    if not len(rep):
        return []
    rep = rep.assign(group=rep["group"].astype(str), op=rep["op"].astype(str))
    keys = ["group", "collective_seq_id"]
    multi = rep.groupby(keys)["rank"].transform("size") > 1
    rep = rep.loc[multi.to_numpy()]
    if not len(rep):
        return []
    out: list[Mismatch] = []
    flagged: set[tuple[str, int]] = set()

    def add(kind: str, g: str, s: int, sub: pd.DataFrame, odd: list[int], detail: str) -> None:
        flagged.add((g, s))
        out.append(
            Mismatch(
                kind=kind,
                group=g,
                seq=s,
                odd_ranks=odd,
                ranks=sorted(int(r) for r in sub["rank"]),
                detail=detail,
            )
        )

    # 1. op type
    nun_op = rep.groupby(keys)["op"].transform("nunique").to_numpy()
    for (g, s), sub in rep.loc[nun_op > 1].groupby(keys):
        odd = _odd_ones(sub["op"], sub["rank"])
        ops = ", ".join(
            f"{op} on {_ranks(sub.loc[sub['op'] == op, 'rank'])}" for op in sub["op"].unique()
        )
        add(
            FindingKind.OP_MISMATCH,
            str(g),
            int(s),
            sub,
            odd,
            f"different ops at seq {s}: {ops}{_odd_calls(sub, odd)}",
        )

    same = rep.loc[nun_op == 1]
    same = same.loc[~same["op"].isin(list(ALL_TO_ALL)).to_numpy()]
    same = same.loc[
        ~same["op"].str.contains(COALESCED_MARK).to_numpy() & (same["n_sub"] == 1).to_numpy()
    ]
    if not len(same):
        return out
    op = same["op"]
    gsize = same["group"].map(
        lambda g: (
            len(groups[g].ranks) if g in groups and groups[g].membership_source != "dumps" else -1
        )
    )

    # 2. sizes, cross-rank
    def cross(col: str, exempt: frozenset[str], kind: str, label: str) -> None:
        cand = same.loc[~op.isin(list(exempt)).to_numpy()]
        if not len(cand):
            return
        vals = cand[col].astype(str)
        nun = vals.groupby([cand["group"], cand["collective_seq_id"]]).transform("nunique")
        for (g, s), sub in cand.loc[(nun > 1).to_numpy()].groupby(keys):
            if (g, s) in flagged:
                continue
            v = sub[col].astype(str)
            odd = _odd_ones(v, sub["rank"])
            shown = "; ".join(f"{x} on {_ranks(sub.loc[v == x, 'rank'])}" for x in v.unique()[:4])
            add(
                kind, str(g), int(s), sub, odd, f"{sub['op'].iloc[0]} #{s}: {label} differ: {shown}"
            )

    cross(
        "input_sizes", frozenset(ALL_TO_ALL | {"scatter"}), FindingKind.SIZE_MISMATCH, "input sizes"
    )
    cross(
        "output_sizes",
        frozenset(ALL_TO_ALL | {"gather"}),
        FindingKind.SIZE_MISMATCH,
        "output sizes",
    )

    # 3. sizes, per rank
    in_n = same["in_numel"].to_numpy()
    out_n = same["out_numel"].to_numpy()
    gs = gsize.to_numpy()
    known = (in_n >= 0) & (out_n >= 0)
    bad = np.zeros(len(same), dtype=bool)
    is_ar = op.isin(list(ALL_REDUCE)).to_numpy()
    bad |= is_ar & (
        same["input_sizes"].astype(str).to_numpy() != same["output_sizes"].astype(str).to_numpy()
    )
    is_ag = op.isin(list(ALL_GATHER)).to_numpy() & (gs > 0) & known
    bad |= is_ag & (out_n != in_n * gs)
    is_rs = op.isin(list(REDUCE_SCATTER)).to_numpy() & (gs > 0) & known
    bad |= is_rs & (in_n != out_n * gs)
    if bad.any():
        for (g, s), sub in same.loc[bad].groupby(keys):
            if (g, s) in flagged:
                continue
            allsub = same.loc[
                (same["group"] == g).to_numpy() & (same["collective_seq_id"] == s).to_numpy()
            ]
            o = sub["op"].iloc[0]
            n = len(groups[g].ranks) if g in groups else -1
            rule = (
                "input equals output"
                if o in ALL_REDUCE
                else f"output numel = input numel x {n}"
                if o in ALL_GATHER
                else f"input numel = output numel x {n}"
            )
            add(
                FindingKind.SIZE_MISMATCH,
                str(g),
                int(s),
                allsub,
                sorted(int(r) for r in sub["rank"]),
                f"{o} #{s}: {_ranks(sub['rank'])} break the rule {rule}",
            )

    # 4. dtypes (as sets)
    in_d = _dtype_set(same["input_dtypes"])
    out_d = _dtype_set(same["output_dtypes"])
    has_in = (in_n > 0) & (in_d.to_numpy() != "")
    has_out = (out_n > 0) & (out_d.to_numpy() != "")
    per_rank = (
        ~op.isin(["scatter", "gather", "broadcast"]).to_numpy()
        & has_in
        & has_out
        & (in_d.to_numpy() != out_d.to_numpy())
    )
    for (g, s), sub in same.loc[per_rank].groupby(keys):
        if (g, s) in flagged:
            continue
        allsub = same.loc[
            (same["group"] == g).to_numpy() & (same["collective_seq_id"] == s).to_numpy()
        ]
        add(
            FindingKind.DTYPE_MISMATCH,
            str(g),
            int(s),
            allsub,
            sorted(int(r) for r in sub["rank"]),
            f"{sub['op'].iloc[0]} #{s}: input and output dtypes differ on {_ranks(sub['rank'])}",
        )
    for vals, exempt, label in (
        (in_d, ["scatter", "broadcast"], "input dtypes"),
        (out_d, ["gather"], "output dtypes"),
    ):
        m = ~op.isin(exempt).to_numpy() & (vals.to_numpy() != "")
        cand = same.loc[m]
        cv = vals.loc[m]
        if not len(cand):
            continue
        nun = cv.groupby([cand["group"], cand["collective_seq_id"]]).transform("nunique")
        for (g, s), sub in cand.loc[(nun > 1).to_numpy()].groupby(keys):
            if (g, s) in flagged:
                continue
            v = cv.loc[sub.index]
            odd = _odd_ones(v, sub["rank"])
            shown = "; ".join(f"{x} on {_ranks(sub.loc[v == x, 'rank'])}" for x in v.unique()[:4])
            add(
                FindingKind.DTYPE_MISMATCH,
                str(g),
                int(s),
                sub,
                odd,
                f"{sub['op'].iloc[0]} #{s}: {label} differ: {shown}",
            )
    return out


def _odd_calls(sub: pd.DataFrame, odd: list[int]) -> str:
    """What the odd ones out called: '; rank 3 calls broadcast, input sizes [[8]], dtypes Half'."""
    if len(odd) == len(sub):
        return ""  # no majority: nobody is the odd one out
    o = sub.loc[sub["rank"].isin(odd).to_numpy()]
    calls: dict[tuple[str, str, str], list[int]] = {}
    for r, op, sizes, dtypes in zip(
        o["rank"], o["op"], o["input_sizes"], o["input_dtypes"], strict=True
    ):
        calls.setdefault((str(op), str(sizes), str(dtypes)), []).append(int(r))
    parts = [
        f"{'rank' if len(rs) == 1 else 'ranks'} {_ranks(rs)} "
        f"{'calls' if len(rs) == 1 else 'call'} {op}, input sizes {sizes}, dtypes {dtypes or '?'}"
        for (op, sizes, dtypes), rs in list(calls.items())[:4]
    ]
    return "; " + "; ".join(parts)


def _ranks(ranks: pd.Series | list[int]) -> str:
    from hangwatch.rankspec import format_ranks

    return format_ranks(sorted(int(r) for r in ranks))
