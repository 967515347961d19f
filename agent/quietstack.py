"""What a quiet rank's main thread is doing: inside torch.compile, or not.

Counters that stop moving mean a hang or work that runs no collective: a
checkpoint, an evaluation, a compile. CPU time tells work from waiting for most
of them (the coordinator's busy rule), but not for ranks that share a compile
cache: torch.compile's inductor builds under a file lock in the cache
directory, and ranks that want the same build wait, idle, in `filelock`'s poll
while the one that holds the lock compiles (measured on torch 2.13, 3 ranks on
one cold cache: two of them idle in the lock for 12.5 s of a 23 s compile).
Their stacks tell: `hangwatch.stacktext.TORCH_COMPILE_FILES`.

So once a rank's counters have been quiet for QUIET_AFTER_S, the agent asks
the rank's worker server for its Python stacks (torch's `dump_traceback`
handler, the one an incident's collection uses), at most once every
RESAMPLE_S while it stays quiet, and reports `RankProgress.in_compile`. The
request costs the rank one faulthandler dump on a worker-server thread, no
import and nothing on the collective path; a rank whose Python does not answer
is not asked (its GIL is held: the status poll found that already).
"""

from __future__ import annotations

import logging
from typing import Final

from hangwatch.agent import endpoint
from hangwatch.agent.ranks import RankTracker

from hangwatch import hook_protocol
from hangwatch.stacktext import main_thread, parse_threads

log = logging.getLogger("hangwatch.agent")

# Quiet this long before the first sample: a rank in a training loop moves a
# counter every step, so only a pause of a second or more is sampled; the
# coordinator's stall timeout (1 s at the least) then finds the answer there.
QUIET_AFTER_S: Final = 1.0
# At most one sample a rank this often while it stays quiet: a compile ends
# or moves on within seconds, and a hang needs no second look.
RESAMPLE_S: Final = 5.0
TIMEOUT_S: Final = 0.5


def sample(t: RankTracker, now: float) -> None:
    """Refresh `t.in_compile` from the rank's stacks when it is due; never raises."""
    # Never at discovery: a rank found as it leaves (a short job's end) would be
    # asked for its stacks while its interpreter finalizes, and measured on
    # torch 2.15 such a request aborted the rank ("terminate called without an
    # active exception", exit -6).
    quiet_since = max((g.changed_at() for g in t.groups.values()), default=t.found_at)
    if now - quiet_since < QUIET_AFTER_S:
        t.in_compile = False  # it moved: whatever it compiled is done
        return
    if now - t.stack_sampled_at < RESAMPLE_S or not t.socket or not t.python_ok:
        return
    t.stack_sampled_at = now
    try:
        text = endpoint.call(t.socket, hook_protocol.DUMP_TRACEBACK, timeout=TIMEOUT_S)
    except (TimeoutError, endpoint.EndpointError) as e:
        log.debug("rank %d: quiet-period stack sample failed: %s", t.rank, e)
        return
    main = main_thread(parse_threads(text.decode("utf-8", "replace")))
    compiling = main is not None and main.in_torch_compile
    if compiling != t.in_compile:
        log.info(
            "rank %d: %s torch.compile (quiet %.1fs)",
            t.rank,
            "inside" if compiling else "no longer inside",
            now - quiet_since,
        )
    t.in_compile = compiling
