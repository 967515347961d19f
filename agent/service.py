"""The agent: one per node. Polls local ranks, reports to the coordinator, answers dump commands.

Threads (none of them in a training process):
- main: discovery and polls, every poll interval; never waits on the network.
- sender: registers, sends progress and events, retries pending uploads;
  backs off with jitter while the coordinator is away.
- commands: holds the WatchCommands stream open and queues DUMP commands.
- dumper: collects bundles (ranks in parallel), keeps them on local disk,
  uploads them, reports CompleteDump; ends ranks on END_RANKS (terminate.py),
  always after any dump queued before it.
Everything buffered is bounded (Config.max_buffered; oldest dropped, counted).
FR entries fetched while polling only teach the trackers op names; they are
not sent (the coordinator discards ReportEntries: incidents carry full dumps).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
from hangwatch.agent import collector, quietstack, terminate, uploader
from hangwatch.agent.causes import causes_first
from hangwatch.agent.client import Backoff, CoordinatorClient, StaleSession
from hangwatch.agent.delta import DeltaReporter
from hangwatch.agent.lateness import ClockSync, next_tick_delay
from hangwatch.agent.outbox import BoundedQueue
from hangwatch.agent.procstate import process_state
from hangwatch.agent.ranks import (
    RankTracker,
    poll_rank,
    read_hook_events,
    scan_rankinfo,
)

from hangwatch import formats, hook_protocol
from hangwatch.config import ABORT, Config
from hangwatch.formats import AgentInfo
from hangwatch.wire import event_kind_name, pb

log = logging.getLogger("hangwatch.agent")

# The agent's threads (sender, commands, dumper) are joined under one
# deadline at shutdown: 5 s in all, where it was 5 s each (15 s for three).
SHUTDOWN_BOUND_S: Final = 5.0
# The whole stop a signal begins, exit included: the poll under way (each
# rank's calls time out, 0.5 s for status and 2 s a recorder's full dump,
# ranks in parallel), SHUTDOWN_BOUND_S, and the exit, which waits for the
# poll pool's threads; past it every thread's stack goes to stderr and the
# process exits 1 (lifecycle.exit_if_stuck). Under the systemd unit's 15 s
# TimeoutStopSec, so the stacks are written before SIGKILL. Measured: 0.17 s
# from SIGTERM to exit (median of 5, an idle agent).
EXIT_BOUND_S: Final = 12.0

_INCIDENT_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_TRAILING_RANK_RE = re.compile(r"(\d+)$")


@dataclass
class PendingDump:
    incident_id: str
    bundles: list[collector.RankBundle]
    uploaded: set[tuple[int, str]] = field(default_factory=set)
    upload_errors: dict[int, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # > 0: phase one of a large incident: FR tails, metas and stacks of every
    # local rank go up in one UploadFiles stream; full dumps stay here.
    tail_context: int = 0
    # The tail decoder child (uploader.start_decoder), started with the
    # collection and used (or stopped) by the first phase-one upload.
    decoder: subprocess.Popen[bytes] | None = None


@dataclass
class _QueuedEvent:
    kind: int
    rank: int
    detail: str
    at: float


class Agent:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.run_dir = os.path.abspath(cfg.agent.run_dir)
        self.client = CoordinatorClient(cfg, agent_id=cfg.agent.node_id, host=socket.gethostname())
        self.poll_interval = cfg.agent.poll_interval
        self.trackers: dict[int, RankTracker] = {}
        # rank -> the last process that held it and exited, until a new one
        # does: its abort-hook and watchdog dumps stay on disk, and an
        # incident collects them (2.15's NCCL ends a rank soon after torch's
        # own timeout dumped it). One per rank: bounded by the node's ranks.
        self.exited: dict[int, RankTracker] = {}
        self._ignored: set[tuple[int, float]] = set()
        self.events: BoundedQueue[_QueuedEvent] = BoundedQueue(cfg.agent.max_buffered)
        self.commands: BoundedQueue[pb.Command] = BoundedQueue(64)
        self.pending: dict[str, PendingDump] = {}
        self._pending_lock = threading.Lock()
        self._collected: set[str] = set()
        # Uploaded and completed, newest last, as many as the node keeps bundles
        # of: a restarted coordinator that lost what it was sent asks again,
        # and gets the same evidence again from the kept copy.
        self._uploaded: OrderedDict[str, PendingDump] = OrderedDict()
        self._ended: set[str] = set()
        self._action_results: BoundedQueue[pb.DumpResult] = BoundedQueue(64)
        self._progress: list[pb.RankProgress] = []
        self._progress_seq = 0
        self._progress_sent = 0
        self._delta = DeltaReporter()
        self.clock = ClockSync()
        self._need_register = True
        self._watchdog_sizes: dict[str, int] = {}
        self._watchdog_reported: set[str] = set()
        self._lock = threading.Lock()
        self.stop = threading.Event()
        self._wake_sender = threading.Event()
        self._wake_dumper = threading.Event()
        self._stream: Any = None
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="hangwatch-agent")
        self._threads: list[threading.Thread] = []
        self.polls = 0

    # --- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        os.makedirs(hook_protocol.hook_dir(self.run_dir), exist_ok=True)
        self._announce()
        for name, target in (
            ("sender", self._sender_loop),
            ("commands", self._command_loop),
            ("dumper", self._dump_loop),
        ):
            th = threading.Thread(target=target, name=f"hangwatch-{name}", daemon=True)
            th.start()
            self._threads.append(th)

    def run(self) -> None:
        """Poll until `stop` is set, then shut down within a few seconds."""
        self.start()
        try:
            while not self.stop.is_set():
                try:
                    self.poll_once()
                except Exception:
                    log.exception("poll failed")
                # On the coordinator's clock grid, so all agents read their
                # ranks at one instant (the straggler signal compares them).
                self.stop.wait(
                    next_tick_delay(self.poll_interval, time.time_ns(), self.clock.offset_ns)
                )
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        self.stop.set()
        self._wake_sender.set()
        self._wake_dumper.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        deadline = time.monotonic() + SHUTDOWN_BOUND_S
        for th in self._threads:
            th.join(timeout=max(0.0, deadline - time.monotonic()))
            if th.is_alive():
                log.warning("%s did not stop within %.0f s", th.name, SHUTDOWN_BOUND_S)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        self._withdraw()

    def _announce(self) -> None:
        """`<run_dir>/agent.json`: the job this agent reports, for `hangwatch run`
        to take its job id from (formats.AgentInfo)."""
        try:
            AgentInfo(
                job_id=self.cfg.job.job_id,
                node_id=self.client.agent_id,
                coordinator=self.cfg.agent.coordinator,
                pid=os.getpid(),
                proc_starttime=hook_protocol.proc_starttime(os.getpid()) or 0,
            ).write(self.run_dir)
        except OSError as e:
            log.warning("could not write %s in %s: %s", AgentInfo.FILE, self.run_dir, e)

    def _withdraw(self) -> None:
        """Remove agent.json if it is still this agent's (a newer one may own it)."""
        try:
            if AgentInfo.load(self.run_dir).pid == os.getpid():
                os.unlink(os.path.join(self.run_dir, AgentInfo.FILE))
        except FileNotFoundError:
            pass  # already gone: nothing to withdraw
        except (OSError, formats.FormatError) as e:
            log.warning("could not remove %s from %s: %s", AgentInfo.FILE, self.run_dir, e)

    # --- polling -------------------------------------------------------------

    def poll_once(self) -> None:
        now = time.monotonic()
        self.discover(now)
        with self._lock:
            trackers = list(self.trackers.values())
        entries_after = max(2.0 * self.poll_interval, 1.0)
        results = list(self._pool.map(lambda t: self._poll_one(t, now, entries_after), trackers))
        for kind, rank, detail in causes_first([ev for res in results for ev in res.events]):
            self.event(kind, rank, detail, now)
        self.scan_watchdog(now)
        with self._lock:
            self._progress = [t.progress_pb(now) for t in trackers]
            self._progress_seq += 1
        self.polls += 1
        self._wake_sender.set()

    def _poll_one(self, t: RankTracker, now: float, entries_after: float) -> Any:
        res = poll_rank(t, now, entries_after)
        if t.state == pb.PROCESS_STATE_RUNNING:
            quietstack.sample(t, now)
        res.events.extend(read_hook_events(t, self.run_dir))
        return res

    def event(self, kind: int, rank: int, detail: str, at: float) -> None:
        log.info("event %s rank %d: %s", event_kind_name(kind), rank, detail)
        self.events.put(_QueuedEvent(kind, rank, detail, at))

    def discover(self, now: float) -> None:
        found = scan_rankinfo(self.run_dir)
        changed = False
        with self._lock:
            for pid, (info, path, mtime) in found.items():
                t = self.trackers.get(pid)
                if t is None:
                    if (pid, mtime) in self._ignored:
                        continue
                    if process_state(pid, info.proc_starttime) == pb.PROCESS_STATE_GONE:
                        # Left over from an earlier run in this directory.
                        self._ignored.add((pid, mtime))
                        log.info("ignoring %s: pid %d is not running", path, pid)
                        continue
                    t = RankTracker(
                        info=info,
                        rankinfo_path=path,
                        rankinfo_mtime=mtime,
                        final_status_path=hook_protocol.final_status_path(self.run_dir, pid),
                    )
                    self.exited.pop(t.rank, None)
                    # A restarted rank replaces the exited process that held its rank.
                    for old_pid, old in list(self.trackers.items()):
                        if old.rank == t.rank and old.exited_reported:
                            del self.trackers[old_pid]
                    self.trackers[pid] = t
                    log.info("found rank %d (pid %d, %s)", t.rank, pid, info.fr_source)
                    if info.job_id and info.job_id != self.cfg.job.job_id:
                        # Reported under the agent's job id all the same; say it
                        # once per rank, so an id left off `hangwatch run` is seen.
                        log.warning(
                            "rank %d (pid %d) says job %r, this agent reports job %r: give "
                            "`hangwatch run` and the agent the same --job-id",
                            t.rank,
                            pid,
                            info.job_id,
                            self.cfg.job.job_id,
                        )
                    changed = True
                elif mtime != t.rankinfo_mtime:
                    t.apply_info(info)
                    t.rankinfo_mtime = mtime
                    changed = True
            for pid, t in list(self.trackers.items()):
                if pid not in found:
                    if not t.exited_reported:
                        t.exited_reported = True
                        self.event(pb.EVENT_KIND_RANK_EXITED, t.rank, "rank-info file removed", now)
                    del self.trackers[pid]
                    self.exited[t.rank] = t
                    changed = True
            if changed:
                self._need_register = True

    def _watch_paths(self) -> dict[str, int]:
        """Dump files ranks may leave: path -> rank. The run dir's fr/ (torch's
        dump-on-timeout files and the hook's per-recorder abort dumps), and any
        dump prefix a job set itself (the hook records it in the rank-info file)."""
        out: dict[str, int] = {}
        fr_dir = os.path.dirname(hook_protocol.fr_dump_prefix(self.run_dir))
        with contextlib.suppress(OSError):
            for name in os.listdir(fr_dir):
                m = _TRAILING_RANK_RE.search(name)
                if m is not None and formats.is_full_fr_name(name):
                    out[os.path.join(fr_dir, name)] = int(m.group(1))
        with self._lock:
            prefixes = {t.info.watchdog_prefix for t in self.trackers.values()} - {""}
        for prefix in prefixes:
            d, stem = os.path.split(prefix)
            if os.path.abspath(d) == os.path.abspath(fr_dir):
                continue
            with contextlib.suppress(OSError):
                for name in os.listdir(d or "."):
                    rest = name[len(stem) :] if name.startswith(stem) else ""
                    if rest.isdigit():
                        out[os.path.join(d, name)] = int(rest)
        return out

    def scan_watchdog(self, now: float) -> None:
        for path, rank in self._watch_paths().items():
            if path in self._watchdog_reported:
                continue
            try:
                size = os.path.getsize(path)
            except OSError:
                continue
            # torch writes the file in place: report it once its size holds still.
            if size > 0 and self._watchdog_sizes.get(path) == size:
                self._watchdog_reported.add(path)
                self.event(pb.EVENT_KIND_WATCHDOG_DUMP, rank, os.path.basename(path), now)
            self._watchdog_sizes[path] = size

    def rank_infos(self) -> list[pb.RankInfo]:
        with self._lock:
            by_rank: dict[int, RankTracker] = {}
            for t in self.trackers.values():
                prev = by_rank.get(t.rank)
                if prev is None or prev.exited_reported:
                    by_rank[t.rank] = t
            return [by_rank[r].rank_info_pb() for r in sorted(by_rank)]

    # --- sending ------------------------------------------------------------

    def _sender_loop(self) -> None:
        backoff = Backoff()
        failing = False
        while not self.stop.is_set():
            try:
                self._flush()
                if failing:
                    log.info("coordinator %s reachable again", self.cfg.agent.coordinator)
                failing = False
                backoff.reset()
                self._wake_sender.wait(timeout=self.poll_interval)
                self._wake_sender.clear()
            except StaleSession as e:
                log.info("re-registering: %s", e)
                with self._lock:
                    self._need_register = True
            except grpc.RpcError as e:
                if not failing:
                    log.warning(
                        "coordinator %s: %s %s; buffering and retrying",
                        self.cfg.agent.coordinator,
                        e.code(),
                        e.details(),
                    )
                failing = True
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    log.error("coordinator rejected the token: %s", e.details())
                self.stop.wait(backoff.next())
            except Exception:
                log.exception("sender failed")
                self.stop.wait(backoff.next())

    def _flush(self) -> None:
        with self._lock:
            need = self._need_register or not self.client.session_id
            self._need_register = False
        if need:
            try:
                self.client.register(self.rank_infos())
            except BaseException:
                with self._lock:
                    self._need_register = True
                raise
            self._progress_sent = 0
            self._delta.reset(self.client.heartbeat_hint)
        if self.clock.due(time.monotonic()):
            self.clock.exchange(self.client.health, time.monotonic())
        with self._lock:
            seq, progress = self._progress_seq, list(self._progress)
        if seq > self._progress_sent:
            now = time.monotonic()
            if self.client.progress_needs_full():
                self._delta.reset()
            pick = self._delta.select(progress, now)
            if pick is not None:
                self.client.report_progress(
                    seq,
                    pick[0],
                    clock_offset_ns=self.clock.offset_ns,
                    clock_error_ns=self.clock.error_ns,
                )
                self._delta.commit(pick[0], pick[1], now)
            self._progress_sent = seq
        while True:
            batch = self.events.take(1)
            if not batch:
                break
            ev = batch[0]
            try:
                self.client.report_event(ev.kind, ev.rank, ev.detail, time.monotonic() - ev.at)
            except BaseException:
                self.events.push_front(batch)
                raise
        while batch := self._action_results.take(1):
            try:
                self.client.complete_dump(batch[0])
            except BaseException:
                self._action_results.push_front(batch)
                raise
        with self._pending_lock:
            pending = list(self.pending.values())
        for p in pending:
            self._finish_dump(p)

    # --- commands and dumps --------------------------------------------------

    def _command_loop(self) -> None:
        backoff = Backoff()
        while not self.stop.is_set():
            sid = self.client.wait_registered(0.5)
            if not sid or self.stop.is_set():
                continue
            try:
                self._stream = self.client.watch_commands()
                for cmd in self._stream:
                    backoff.reset()
                    self.commands.put(cmd)
                    self._wake_dumper.set()
                # Ended by the server: a newer Register replaced this session.
                if self.client.session_id == sid:
                    self.stop.wait(backoff.next())
            except grpc.RpcError as e:
                if self.stop.is_set():
                    break
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self.client.invalidate()
                    with self._lock:
                        self._need_register = True
                    self._wake_sender.set()
                if self.client.commands_failed(e):
                    continue  # the relay failed: straight to the coordinator now
                self.stop.wait(backoff.next())
            finally:
                self._stream = None

    def _dump_loop(self) -> None:
        while not self.stop.is_set():
            cmds = self.commands.take(1)
            if not cmds:
                self._wake_dumper.wait(timeout=0.5)
                self._wake_dumper.clear()
                continue
            try:
                self.handle_command(cmds[0])
            except Exception:
                log.exception("dump command failed")

    def handle_command(self, cmd: pb.Command) -> PendingDump | None:
        kinds = (pb.COMMAND_KIND_DUMP, pb.COMMAND_KIND_UPLOAD_FULL, pb.COMMAND_KIND_END_RANKS)
        if cmd.kind not in kinds:
            log.warning("ignoring unknown command kind %d", cmd.kind)
            return None
        iid = cmd.incident_id
        if not _INCIDENT_ID_RE.match(iid) or ".." in iid:
            log.error("refusing dump command with unsafe incident id %r", iid[:80])
            return None
        if cmd.kind == pb.COMMAND_KIND_UPLOAD_FULL:
            self.upload_full(iid, list(cmd.ranks))
            return None
        if cmd.kind == pb.COMMAND_KIND_END_RANKS:
            self.end_ranks(cmd)
            return None
        if iid in self._collected:
            with self._pending_lock:
                p = self.pending.get(iid) or self._resend(iid)
            if p is not None:
                log.info("incident %s already collected; finishing its upload", iid)
                self._try_finish(p)
                return p
            # The kept copy was pruned: collect again; what is there now is
            # still more than nothing.
            log.info("incident %s asked again, its kept bundle pruned: collecting anew", iid)
        log.info("dump for incident %s (%s)", iid, cmd.reason)
        t0 = time.monotonic()
        p = self.collect(iid, tail_context=cmd.tail_context)
        with self._pending_lock:
            busy = set(self.pending)
        gone = collector.prune_bundles(
            self.run_dir, keep=self.cfg.agent.keep_bundles, protect=busy | {iid}
        )
        if gone:
            log.info("deleted %d old incident bundle(s): %s", len(gone), ", ".join(gone))
        log.info(
            "incident %s: collected %d ranks in %.2fs",
            iid,
            len(p.bundles),
            time.monotonic() - t0,
        )
        self._try_finish(p)
        return p

    def _resend(self, iid: str) -> PendingDump | None:
        """An uploaded incident asked for again (a restarted coordinator that lost
        files), made pending again to send every file from the kept copy; files
        the coordinator already holds are acknowledged, not rewritten. None when
        the copy was pruned. Called with the pending lock held."""
        p = self._uploaded.get(iid)
        if p is None or not all(
            os.path.isfile(os.path.join(b.directory, n)) for b in p.bundles for n in b.files
        ):
            return None
        p.uploaded.clear()
        p.upload_errors.clear()
        self.pending[iid] = p
        log.info("incident %s asked again; re-sending the kept bundle", iid)
        return p

    def end_ranks(self, cmd: pb.Command) -> None:
        """Once per incident (a command re-sent after a reconnect is not re-run);
        the answer goes up with the sender's next flush."""
        if cmd.incident_id in self._ended:
            return
        self._ended.add(cmd.incident_id)
        with self._lock:
            known = {p: (t.rank, t.info.proc_starttime) for p, t in self.trackers.items()}
        res = terminate.answer(
            cmd,
            known,
            allowed=self.cfg.respond.on_hang == ABORT,
            job_id=self.cfg.job.job_id,
            agent_id=self.client.agent_id,
        )
        self._action_results.put(res)
        self._wake_sender.set()

    def collect(self, incident_id: str, *, tail_context: int = 0) -> PendingDump:
        with self._lock:
            trackers = list(self.trackers.values())
            live = {t.rank for t in trackers}
            # Exited ranks too: what they left on disk (abort, watchdog dumps).
            trackers += [t for r, t in self.exited.items() if r not in live]
        # Phase one goes as a node archive with the tails decoded; the decoder
        # starts now, to load while the ranks are dumped.
        decoder = (
            uploader.start_decoder() if tail_context > 0 and self.client.node_archives else None
        )
        try:
            bundles = self._collect_ranks(trackers, incident_id, tail_context)
        except BaseException:
            uploader.stop_decoder(decoder)
            raise
        p = PendingDump(
            incident_id=incident_id, bundles=bundles, tail_context=tail_context, decoder=decoder
        )
        with self._pending_lock:
            self.pending[incident_id] = p
        self._collected.add(incident_id)
        return p

    def _collect_ranks(
        self, trackers: list[RankTracker], incident_id: str, tail_context: int
    ) -> list[collector.RankBundle]:
        gpu = collector.gpu_snapshot()
        # error_ns is 0 until a round trip measured the offset.
        clock = (self.clock.offset_ns, self.clock.error_ns) if self.clock.error_ns else None
        futures = [
            self._pool.submit(
                collector.collect_rank,
                t,
                run_dir=self.run_dir,
                incident_id=incident_id,
                pyspy=self.cfg.agent.pyspy,
                gpu=gpu,
                tail_context=tail_context,
                clock=clock,
            )
            for t in trackers
        ]
        return [f.result() for f in futures]

    def _try_finish(self, p: PendingDump) -> None:
        try:
            self._finish_dump(p)
        except (grpc.RpcError, StaleSession) as e:
            log.warning(
                "incident %s: upload deferred (%s); kept in %s", p.incident_id, e, self.run_dir
            )

    def _upload_phase_one(self, p: PendingDump) -> None:
        """Every local rank's tail (or its whole FR when no tail could be cut)
        and meta (stacks inside) in one stream; the full FR files are marked
        done here and wait on disk for an UPLOAD_FULL."""
        todo: list[tuple[str, int]] = []
        for b in p.bundles:
            for name in b.files:
                # Kept on the node: a full FR file that has a tail, until
                # UPLOAD_FULL; stacks.txt when meta.json carries the same text.
                if (formats.is_full_fr_name(name) and formats.tail_name_for(name) in b.files) or (
                    name == formats.STACKS_FILE and b.meta.stacks is not None
                ):
                    p.uploaded.add((b.rank, name))
                elif (b.rank, name) not in p.uploaded:
                    todo.append((os.path.join(b.directory, name), b.rank))
        decoder, p.decoder = p.decoder, None
        if not todo or not self.client.node_archives:
            uploader.stop_decoder(decoder)
        if not todo:
            return
        try:
            if self.client.node_archives:
                uploader.upload_node_archive(
                    self.client, todo, incident_id=p.incident_id, decoder=decoder
                )
            else:
                uploader.upload_files(self.client, todo, incident_id=p.incident_id)
        except RuntimeError as e:
            log.warning("incident %s: %s; uploading file by file", p.incident_id, e)
            return
        except grpc.RpcError as e:
            if e.code() not in uploader.BATCH_REFUSED:
                raise
            # Refused as a batch: the per-file path below retries each file
            # on its own, so one bad file cannot sink the node's evidence.
            log.warning(
                "incident %s: batched upload refused (%s: %s); uploading file by file",
                p.incident_id,
                e.code().name,
                e.details(),
            )
            return
        for path, rank in todo:
            p.uploaded.add((rank, os.path.basename(path)))

    def upload_full(self, incident_id: str, ranks: list[int]) -> list[int]:
        """Phase two: the full FR dumps this node kept, for the ranks asked."""
        sent: list[int] = []
        for r in ranks:
            d = collector.rank_dir(self.run_dir, incident_id, r)
            try:
                names = sorted(n for n in os.listdir(d) if formats.is_full_fr_name(n))
            except OSError:
                continue  # not one of ours, or the rank left no dump
            try:
                for name in names:  # one per recorder instance
                    uploader.upload_file(
                        self.client, os.path.join(d, name), incident_id=incident_id, rank=r
                    )
                if names:
                    sent.append(r)
            except (grpc.RpcError, RuntimeError) as e:
                log.warning("incident %s: full FR of rank %d not uploaded: %s", incident_id, r, e)
        log.info("incident %s: uploaded full FR dumps of ranks %s", incident_id, sent)
        return sent

    def _finish_dump(self, p: PendingDump) -> None:
        """Upload what is left of the bundle, then CompleteDump. Raises on network errors."""
        if not p.lock.acquire(blocking=False):
            return  # another thread is on it
        try:
            if p.tail_context:
                self._upload_phase_one(p)
            for b in p.bundles:
                for name in b.files:
                    if (b.rank, name) in p.uploaded:
                        continue
                    path = os.path.join(b.directory, name)
                    try:
                        uploader.upload_file(
                            self.client, path, incident_id=p.incident_id, rank=b.rank
                        )
                    except grpc.RpcError as e:
                        if e.code() in uploader.REFUSED:
                            # Refused, not unreachable: retrying would not help.
                            p.upload_errors[b.rank] = f"{name}: {e.code().name}: {e.details()}"
                            p.uploaded.add((b.rank, name))
                            continue
                        raise
                    p.uploaded.add((b.rank, name))
            failures = []
            dumped = []
            for b in p.bundles:
                reason = b.failure or p.upload_errors.get(b.rank, "")
                if reason:
                    failures.append(pb.RankFailure(rank=b.rank, reason=reason[:1000]))
                else:
                    dumped.append(b.rank)
            accepted = self.client.complete_dump(
                pb.DumpResult(
                    job_id=self.cfg.job.job_id,
                    agent_id=self.client.agent_id,
                    incident_id=p.incident_id,
                    ranks_dumped=dumped,
                    failures=failures,
                )
            )
            log.info(
                "incident %s: uploaded; dumped %s, failed %s (accepted=%s)",
                p.incident_id,
                dumped,
                {f.rank: f.reason for f in failures},
                accepted,
            )
            with self._pending_lock:
                self.pending.pop(p.incident_id, None)
                self._uploaded[p.incident_id] = p
                self._uploaded.move_to_end(p.incident_id)
                while len(self._uploaded) > max(1, self.cfg.agent.keep_bundles):
                    self._uploaded.popitem(last=False)
        finally:
            p.lock.release()
