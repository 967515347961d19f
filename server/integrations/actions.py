"""Acting on a verdict: node exclusion (--exclude-command) and abort-for-restart (--on-hang abort).

Both are off by default and run only after an incident is analysed, that is
after every dump that arrived is stored durably and the verdict is stored:
nothing here can cost the evidence. They run on a worker thread of their own,
so a slow or failing action never holds up detection, collection or analysis,
and whatever goes wrong is recorded in the incident, never raised.

Order, for one incident whose verdict is in ACT_VERDICTS:
1. exclusion: the operator's command once per node of the lagging ranks (at
   most MAX_EXCLUDE_NODES), argv substitution only, no shell, host and node
   names checked, a timeout, the output kept (bounded). It comes first so a
   launcher that reschedules (Slurm requeue, Kubernetes) does not land the
   restarted job on the node being drained.
2. abort: unless the job made progress since the incident opened (the stall
   cleared by itself), every connected agent of the job gets END_RANKS for its
   ranks (pid included); it answers with what became of each process.
Safety model: docs/operations.md, "Actions".
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final

from hangwatch.analyzer.report import Report
from hangwatch.server.incidents.action_records import ABORT, EXCLUDE, ActionRecord, RankOutcome
from hangwatch.server.incidents.hosts import OffenderRule
from hangwatch.server.incidents.store import IncidentRow, IncidentStatus, IncidentStore
from hangwatch.server.integrations.metrics import Metrics
from hangwatch.server.live.commands import Command
from hangwatch.server.live.registry import JobRegistry
from hangwatch.server.workers import executor_threads

from hangwatch import config
from hangwatch.wire import pb

log = logging.getLogger(__name__)

# Verdicts that mean a collective will never complete: the only ones acted on.
ACT_VERDICTS: Final = ("hang", "mismatch")
# A verdict blaming more nodes than this is not trusted to drain them all.
MAX_EXCLUDE_NODES: Final = 8
MAX_OUTPUT_BYTES: Final = 4096
# How long past grace + SIGKILL wait (agent/terminate.py) the agents may take to answer.
ANSWER_MARGIN_S: Final = 15.0
AGENT_KILL_WAIT_S: Final = 5.0
# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_LABEL: Final = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")

# (event, the incident as stored, the action that just finished)
Publish = Callable[[str, IncidentRow, ActionRecord], None]


def valid_host(name: str) -> bool:
    """An RFC 1123 host name: never empty, never an option (no leading '-'),
    nothing a command could read as a path, a glob or more than one word."""
    if not name or len(name) > 253:
        return False
    return all(_LABEL.match(label) for label in name.removesuffix(".").split("."))


def exclude_argv(template: tuple[str, ...], *, host: str, node: str, ranks: list[int],
                 incident: str) -> list[str]:  # fmt: skip
    """The words to run: each template word filled in (str.format on a word
    Config.exclude_argv checked), the values never re-split."""
    values = {"host": host, "node": node, "ranks": ",".join(map(str, ranks)), "incident": incident}
    return [w.format(**values) for w in template]


@dataclass(frozen=True, kw_only=True)
class ActionPolicy:
    on_hang: str = config.OBSERVE
    grace_s: float = 10.0
    exclude_argv: tuple[str, ...] = ()
    exclude_timeout_s: float = 30.0
    # --exclude-repeat-offenders-only: exclude a host only once it is one.
    offenders_only: bool = False
    offender_rule: OffenderRule = field(default_factory=OffenderRule)

    @classmethod
    def from_config(cls, c: config.Config) -> ActionPolicy:
        return cls(
            on_hang=c.respond.on_hang,
            grace_s=c.respond.abort_grace,
            exclude_argv=c.respond.exclude_argv(),
            exclude_timeout_s=c.respond.exclude_timeout,
            offenders_only=c.respond.exclude_repeat_offenders_only,
            offender_rule=OffenderRule.from_config(c),
        )

    @property
    def enabled(self) -> bool:
        return self.on_hang == config.ABORT or bool(self.exclude_argv)


@dataclass
class _Abort:
    incident_id: str
    job_id: str
    record: ActionRecord
    waiting: set[str]  # agents yet to answer
    done: threading.Event = field(default_factory=threading.Event)


class ActionRunner:
    def __init__(
        self,
        policy: ActionPolicy,
        *,
        store: IncidentStore,
        registry: JobRegistry,
        metrics: Metrics,
        publish: Publish | None = None,
    ) -> None:
        self.policy = policy
        self.store = store
        self.registry = registry
        self.metrics = metrics
        self._publish = publish
        self._lock = threading.Lock()
        self._aborts: dict[str, _Abort] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hangwatch-actions")

    def threads(self) -> list[threading.Thread]:
        return executor_threads(self._pool)

    def close(self) -> None:
        with self._lock:
            for a in self._aborts.values():
                a.done.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- inputs -------------------------------------------------------------

    def on_analyzed(self, incident_id: str, job_id: str, opened: float, report: Report) -> None:
        """The verdict is stored (`opened`: registry time the incident opened).
        Returns at once; the actions run on the runner's thread."""
        if not self.policy.enabled:
            return
        self._pool.submit(self._act_safely, incident_id, job_id, opened, report)

    def on_result(self, res: pb.DumpResult) -> bool:
        """An agent's END_RANKS answer (CompleteDump with `actions`)."""
        with self._lock:
            a = self._aborts.get(res.incident_id)
            if a is None or a.job_id != res.job_id or res.agent_id not in a.waiting:
                return False
            a.waiting.discard(res.agent_id)
            by_key = {(o.rank, o.pid): o for o in a.record.ranks if o.node == res.agent_id}
            for r in res.actions:
                o = by_key.get((r.rank, r.pid))
                if o is None:
                    continue
                o.outcome = r.outcome
                o.signals = list(r.signals)
                o.exit_s = r.exit_s if r.exit_s > 0 else None
                o.detail = r.detail
            if not a.waiting:
                a.done.set()
        self.registry.retire_command(
            res.job_id, res.agent_id, res.incident_id, kind=pb.COMMAND_KIND_END_RANKS
        )
        return True

    # ---- the runner's thread -------------------------------------------------

    def _act_safely(self, incident_id: str, job_id: str, opened: float, report: Report) -> None:
        try:
            self._act(incident_id, job_id, opened, report)
        except Exception:
            log.exception("incident %s: actions failed", incident_id)

    def _act(self, incident_id: str, job_id: str, opened: float, report: Report) -> None:
        records: list[ActionRecord] = []
        why = self._why_not(incident_id, job_id, opened, report)
        if why:
            records = [_skipped(kind, why) for kind in self._kinds()]
            self._save(incident_id, records, *records)
            return
        if self.policy.exclude_argv:
            for rec in self._exclude(incident_id, job_id, report):
                records.append(rec)
                self._save(incident_id, records, rec)
        if self.policy.on_hang == config.ABORT:
            self._abort(incident_id, job_id, opened, report, records)

    def _why_not(self, incident_id: str, job_id: str, opened: float, report: Report) -> str:
        """Why no action may be taken now ("" when one may)."""
        if report.verdict not in ACT_VERDICTS:
            return f"verdict is {report.verdict}: only {' and '.join(ACT_VERDICTS)} are acted on"
        row = self.store.get_incident(incident_id)
        if row is not None and row.status != IncidentStatus.ANALYZED:
            return f"the incident is {row.status}"
        if self.registry.progressed_since(job_id, opened):
            return "the job made progress after the incident opened: the stall cleared"
        return ""

    def _kinds(self) -> list[str]:
        kinds = [EXCLUDE] if self.policy.exclude_argv else []
        return kinds + ([ABORT] if self.policy.on_hang == config.ABORT else [])

    def _save(self, incident_id: str, records: list[ActionRecord], *done: ActionRecord) -> None:
        """Store the records; `done` are the ones that just finished (counted, published)."""
        row = self.store.set_actions(incident_id, records)
        for rec in done:
            self.metrics.inc(
                "hangwatch_actions_total", labels={"kind": rec.kind, "status": rec.status}
            )
        if self._publish is None:
            return
        for rec in done:
            try:
                self._publish("incident.action", row, rec)
            except Exception:
                log.exception("incident %s: could not publish its action", incident_id)

    # ---- exclusion ------------------------------------------------------------

    def _exclude(self, incident_id: str, job_id: str, report: Report) -> list[ActionRecord]:
        snap = self.registry.snapshot(job_id)
        where = {r.rank: (r.agent_id, r.host) for r in snap.ranks} if snap else {}
        nodes: dict[tuple[str, str], list[int]] = {}
        unplaced: list[int] = []
        for rank in report.lagging_ranks:
            if rank in where:
                nodes.setdefault(where[rank], []).append(rank)
            else:
                unplaced.append(rank)
        out: list[ActionRecord] = []
        if unplaced:
            out.append(_failed(EXCLUDE, f"no node known for lagging ranks {unplaced}"))
        if len(nodes) > MAX_EXCLUDE_NODES:
            out.append(
                _skipped(
                    EXCLUDE,
                    f"the verdict blames {len(nodes)} nodes; more than {MAX_EXCLUDE_NODES} are"
                    " never excluded for one incident",
                )
            )
            return out
        for (node, host), ranks in sorted(nodes.items()):
            why = self._not_an_offender(host)
            if why:
                out.append(_skipped(EXCLUDE, why))
                continue
            out.append(self._exclude_one(incident_id, node, host, sorted(ranks)))
        return out

    def _not_an_offender(self, host: str) -> str:
        """Why `host` is not excluded under --exclude-repeat-offenders-only ("" if it is
        to be): this incident's verdict is stored, so it is already counted."""
        if not self.policy.offenders_only:
            return ""
        rule = self.policy.offender_rule
        [h] = self.store.host_history(since=rule.since(time.time()), host=host) or [None]
        if h is not None and rule.applies(h):
            return ""
        n = 0 if h is None else h.incidents
        return (
            f"{host} held the culprit of {n} incidents within the window; "
            f"--exclude-repeat-offenders-only excludes a host from {rule.incidents}"
        )

    def _exclude_one(
        self, incident_id: str, node: str, host: str, ranks: list[int]
    ) -> ActionRecord:
        rec = ActionRecord(
            kind=EXCLUDE, status="running", started=time.time(), summary="", node=node, host=host
        )
        bad = [f"{k} {v!r}" for k, v in (("host", host), ("node", node)) if not valid_host(v)]
        if bad:
            rec.status = "failed"
            rec.summary = f"refused: {' and '.join(bad)} not an RFC 1123 host name; nothing run"
            rec.finished = time.time()
            log.error("incident %s: exclusion %s", incident_id, rec.summary)
            return rec
        rec.argv = exclude_argv(
            self.policy.exclude_argv, host=host, node=node, ranks=ranks, incident=incident_id
        )
        rec.returncode, rec.output, why = run_bounded(rec.argv, self.policy.exclude_timeout_s)
        rec.finished = time.time()
        rec.status = "done" if rec.returncode == 0 else "failed"
        rec.summary = why or f"{rec.argv[0]} for {host} exited {rec.returncode}"
        log.warning("incident %s: exclusion of %s: %s", incident_id, host, rec.summary)
        return rec

    # ---- abort ------------------------------------------------------------------

    def _abort(
        self,
        incident_id: str,
        job_id: str,
        opened: float,
        report: Report,
        records: list[ActionRecord],
    ) -> None:
        # Checked again: the exclusion may have taken its time.
        why = self._why_not(incident_id, job_id, opened, report)
        if why:
            return self._finish(incident_id, records, _skipped(ABORT, why))
        snap = self.registry.snapshot(job_id)
        rec = ActionRecord(kind=ABORT, status="running", started=time.time(), summary="")
        by_agent: dict[str, list[tuple[int, int]]] = {}
        for r in snap.ranks if snap else []:
            if r.connected and r.pid > 0:
                by_agent.setdefault(r.agent_id, []).append((r.rank, r.pid))
                rec.ranks.append(RankOutcome(rank=r.rank, pid=r.pid, node=r.agent_id))
            else:
                rec.ranks.append(
                    RankOutcome(
                        rank=r.rank,
                        pid=r.pid,
                        node=r.agent_id,
                        outcome="no-answer",
                        detail="its agent is not connected: not asked",
                    )
                )
        if not by_agent:
            return self._finish(
                incident_id, records, _failed(ABORT, "no connected agent to end the ranks")
            )
        wait_s = self.policy.grace_s + AGENT_KILL_WAIT_S + ANSWER_MARGIN_S
        a = _Abort(incident_id=incident_id, job_id=job_id, record=rec, waiting=set(by_agent))
        with self._lock:
            self._aborts[incident_id] = a
        records.append(rec)
        rec.summary = (
            f"asked {len(by_agent)} agent(s) to end {sum(map(len, by_agent.values()))} ranks"
        )
        self._save(incident_id, records)
        now = self.registry.now()
        reason = f"incident {incident_id}: --on-hang abort"
        for agent_id, procs in by_agent.items():
            cmd = Command(
                kind=pb.COMMAND_KIND_END_RANKS,
                incident_id=incident_id,
                reason=reason,
                deadline_s=wait_s,
                expires=now + wait_s,
                ranks=tuple(r for r, _ in procs),
                pids=tuple(p for _, p in procs),
                grace_s=self.policy.grace_s,
            )
            if not self.registry.push_command(job_id, agent_id, cmd):
                with self._lock:
                    a.waiting.discard(agent_id)
                    for o in rec.ranks:
                        if o.node == agent_id:
                            o.outcome, o.detail = "no-answer", "agent unknown: not asked"
                    if not a.waiting:
                        a.done.set()
        log.warning("incident %s: %s", incident_id, rec.summary)
        a.done.wait(wait_s)
        with self._lock:
            self._aborts.pop(incident_id, None)
            for o in rec.ranks:
                if o.outcome == "pending":
                    o.outcome, o.detail = "no-answer", f"no answer within {wait_s:.0f}s"
            rec.finished = time.time()
            ended = [o.rank for o in rec.ranks if o.outcome in ("terminated", "killed")]
            gone = [o.rank for o in rec.ranks if o.outcome == "already-gone"]
            rest = [o for o in rec.ranks if o.rank not in ended and o.rank not in gone]
            rec.status = "done" if not rest else ("partial" if ended else "failed")
            rec.summary = _abort_summary(ended, gone, rest)
        log.warning("incident %s: abort %s: %s", incident_id, rec.status, rec.summary)
        self._save(incident_id, records, rec)

    def _finish(self, incident_id: str, records: list[ActionRecord], rec: ActionRecord) -> None:
        records.append(rec)
        self._save(incident_id, records, rec)


def _abort_summary(ended: list[int], gone: list[int], rest: list[RankOutcome]) -> str:
    parts = []
    if ended:
        parts.append(f"ended ranks {','.join(map(str, ended))}")
    if gone:
        parts.append(f"ranks {','.join(map(str, gone))} had already exited")
    for outcome in sorted({o.outcome for o in rest}):
        ranks = ",".join(str(o.rank) for o in rest if o.outcome == outcome)
        parts.append(f"ranks {ranks}: {outcome}")
    return "; ".join(parts) or "no ranks"


def _skipped(kind: str, why: str) -> ActionRecord:
    t = time.time()
    return ActionRecord(kind=kind, status="skipped", started=t, finished=t, summary=why)


def _failed(kind: str, why: str) -> ActionRecord:
    t = time.time()
    return ActionRecord(kind=kind, status="failed", started=t, finished=t, summary=why)


def run_bounded(argv: list[str], timeout_s: float) -> tuple[int | None, str, str]:
    """Run argv (no shell), stdin closed, in its own session; keep the first
    MAX_OUTPUT_BYTES of stdout and stderr together. (returncode, output, why
    it failed to run or finish: "" when it ran to its end)."""
    environ = {k: v for k, v in os.environ.items() if k != config.env_var("token")}
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=environ,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as e:
        return None, "", f"cannot run {argv[0]!r}: {e.strerror or e}"
    assert proc.stdout is not None
    head = bytearray()

    def drain() -> None:
        assert proc.stdout is not None
        while chunk := os.read(proc.stdout.fileno(), 65536):
            if len(head) < MAX_OUTPUT_BYTES:
                head.extend(chunk[: MAX_OUTPUT_BYTES - len(head)])

    reader = threading.Thread(target=drain, name="hangwatch-exclude-output", daemon=True)
    reader.start()
    why = ""
    try:
        rc: int | None = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        # The whole session: a wrapper script's children go with it.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.wait()
        rc = None
        why = f"killed after the {timeout_s:g}s timeout"
    reader.join(5.0)
    proc.stdout.close()
    return rc, head.decode("utf-8", "replace"), why
