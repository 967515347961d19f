"""The hang zoo: every fault the harness can inject, with its ground truth.

Ground truth is derived from the injection plan alone (which rank does what,
at which collective), never from running the analyzer. The plan is fixed:

* Every rank creates the scenario's extra groups in the same order, so torch
  names them "1", "2", ... ("0" is the default group) on every rank, members
  or not.
* One healthy training step first does one `all_reduce` on each extra group
  the scenario trains on (members only), then `all_reduce`, `broadcast` and
  `all_gather` on the default group (3 collectives).
* The fault hits at the start of step K (0-based), i.e. the default group's
  collective seq `3*K + 1` and an extra group's seq `K + 1`. Gloo numbers a
  group's collectives from 1 and records no p2p ops (see docs/hang-zoo.md).

Nothing here imports torch: the analyzer tests, the demo and the benchmarks
read these objects on machines without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from hangwatch.testing.backends import COMPLETION_UNKNOWN

Verdict = Literal["hang", "mismatch", "no-culprit-visible", "healthy", "unknown"]

DEFAULT_GROUP = "0"
# Collectives one healthy step issues on the default group, in order.
DEFAULT_STEP_OPS = ("all_reduce", "broadcast", "all_gather")
# ... and on each extra group a scenario trains on.
EXTRA_STEP_OPS = ("all_reduce",)
DEFAULT_FR_BUFFER = 2000


@dataclass(frozen=True, kw_only=True)
class CollectiveAt:
    """One collective of the plan: group name, seq within the group, op.

    `op` is the normalized op name (backend prefix stripped): gloo records
    `gloo:all_reduce`, the analyzer reports `all_reduce`.
    """

    group: str
    seq: int
    op: str

    def to_dict(self) -> dict[str, object]:
        return {"group": self.group, "seq": self.seq, "op": self.op}


def seq_at_step(group: str, step: int) -> int:
    """The seq of the first collective a group issues in step `step` (0-based)."""
    per_step = len(DEFAULT_STEP_OPS) if group == DEFAULT_GROUP else len(EXTRA_STEP_OPS)
    return step * per_step + 1


def _first(group: str, steps: int) -> CollectiveAt:
    return CollectiveAt(group=group, seq=seq_at_step(group, steps), op="all_reduce")


GroupsFn = Callable[[int], tuple[tuple[int, ...], ...]]
RanksFn = Callable[[int], tuple[int, ...]]
InFlightFn = Callable[[int, int], dict[int, CollectiveAt]]


def _no_groups(world: int) -> tuple[tuple[int, ...], ...]:
    return ()


def _nobody(world: int) -> tuple[int, ...]:
    return ()


def _rank(r: int) -> RanksFn:
    def fn(world: int) -> tuple[int, ...]:
        return (r,)

    return fn


def _last_rank(world: int) -> tuple[int, ...]:
    return (world - 1,)


def _all_but(guilty: RanksFn) -> InFlightFn:
    """Everyone except the guilty ranks waits in the default group's next collective."""

    def fn(world: int, steps: int) -> dict[int, CollectiveAt]:
        g = set(guilty(world))
        return {r: _first(DEFAULT_GROUP, steps) for r in range(world) if r not in g}

    return fn


def _nothing_in_flight(world: int, steps: int) -> dict[int, CollectiveAt]:
    return {}


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One entry of the hang zoo.

    `guilty_ranks` are the ranks the fault was injected into; `lagging_ranks`
    are the ranks an analyzer of FR dumps is expected to name (they differ only
    where FR cannot see the fault: gloo p2p). `silent_ranks` cannot write a dump
    of their own (stopped, or holding the GIL). `in_flight` maps each rank to
    the collective it is blocked in, when it is blocked in one.
    """

    name: str
    description: str
    min_world: int
    verdict: Verdict
    guilty: RanksFn
    silent: RanksFn = _nobody
    # Member lists of the extra groups, created in this order by every rank.
    groups: GroupsFn = _no_groups
    # Which extra groups (by name) do one all_reduce per healthy step.
    trains_on: tuple[str, ...] = ()
    stalled_group: str | None = DEFAULT_GROUP
    # False where FR is blind to the fault (p2p under gloo).
    fr_visible: bool = True
    in_flight: InFlightFn = _nothing_in_flight
    default_steps: int = 3
    # Seconds of fake compute per healthy step.
    step_time: float = 0.005
    fr_buffer_size: int = DEFAULT_FR_BUFFER
    # The verdict where torch's FlightRecorderHook records the job on a backend
    # without completion hooks (the hwstore test backend; any backend written
    # in Python), if it differs: such a recorder does not record completion,
    # so "healthy" cannot be proven there. A backend with completion hooks
    # (torch 2.15's default NCCL; hwhooks) keeps the scenario's verdict.
    hooked_verdict: Verdict | None = None

    def for_backend(self, backend: str) -> Scenario:
        """This scenario's ground truth on a job run with `backend`."""
        if backend not in COMPLETION_UNKNOWN or self.hooked_verdict is None:
            return self
        return replace(self, verdict=self.hooked_verdict, hooked_verdict=None)

    def check_world(self, world: int) -> None:
        if world < self.min_world:
            raise ValueError(
                f"scenario {self.name!r} needs at least {self.min_world} ranks, got {world}"
            )

    def guilty_ranks(self, world: int) -> list[int]:
        self.check_world(world)
        return sorted(self.guilty(world))

    def lagging_ranks(self, world: int) -> list[int]:
        return self.guilty_ranks(world) if self.fr_visible else []

    def silent_ranks(self, world: int) -> list[int]:
        self.check_world(world)
        return sorted(self.silent(world))

    def dumping_ranks(self, world: int) -> list[int]:
        silent = set(self.silent_ranks(world))
        return [r for r in range(world) if r not in silent]

    def stalled(self, world: int, steps: int) -> CollectiveAt | None:
        """The collective an analyzer should report as stalled, or None."""
        self.check_world(world)
        if self.stalled_group is None:
            return None
        return _first(self.stalled_group, steps)

    def expected_in_flight(self, world: int, steps: int) -> dict[int, CollectiveAt]:
        self.check_world(world)
        return self.in_flight(world, steps)

    @property
    def snapshot_layout(self) -> str:
        """The layout a snapshot of this scenario takes by default.

        What the real system would leave behind: a stalled job raises an
        incident, whose bundle carries per-rank `meta.json` and stacks (and
        the analyzer reads a bundle as "a stall was reported"). A healthy job
        raises none, so its dumps are plain FR files, as from a manual dump.
        """
        return "plain" if self.verdict in ("healthy", "unknown") else "bundle"

    def expected(self, world: int, steps: int) -> dict[str, object]:
        """The `expected` block of a golden manifest."""
        st = self.stalled(world, steps)
        return {
            "verdict": self.verdict,
            "lagging_ranks": self.lagging_ranks(world),
            "stalled": st.to_dict() if st else None,
        }


# --- scenario-specific ground truth -------------------------------------------------


def _subgroup_members(world: int) -> tuple[int, ...]:
    return (world - 2, world - 1)


def _subgroup_groups(world: int) -> tuple[tuple[int, ...], ...]:
    return (_subgroup_members(world),)


def _subgroup_in_flight(world: int, steps: int) -> dict[int, CollectiveAt]:
    waiter, _culprit = _subgroup_members(world)
    out = {r: _first(DEFAULT_GROUP, steps) for r in range(world - 2)}
    out[waiter] = _first("1", steps)
    return out


def _whole_world_group(world: int) -> tuple[tuple[int, ...], ...]:
    return (tuple(range(world)),)


def _order_in_flight(world: int, steps: int) -> dict[int, CollectiveAt]:
    out = {r: _first("1", steps) for r in range(world) if r != 1}
    out[1] = _first(DEFAULT_GROUP, steps)
    return out


def _mismatch_in_flight(world: int, steps: int) -> dict[int, CollectiveAt]:
    out = {r: _first(DEFAULT_GROUP, steps) for r in range(world)}
    out[2] = CollectiveAt(
        group=DEFAULT_GROUP, seq=seq_at_step(DEFAULT_GROUP, steps), op="broadcast"
    )
    return out


def _two_guilty(world: int) -> tuple[int, ...]:
    return (1, world - 1)


_SCENARIOS = (
    Scenario(
        name="skip",
        description="Rank 1 never enters the next collective: it blocks outside any collective "
        "(like a data loader that never yields) while the others wait in it.",
        min_world=2,
        verdict="hang",
        guilty=_rank(1),
        in_flight=_all_but(_rank(1)),
    ),
    Scenario(
        name="compute",
        description="Rank 2 spins in pure-Python compute and never reaches the next collective.",
        min_world=3,
        verdict="hang",
        guilty=_rank(2),
        in_flight=_all_but(_rank(2)),
    ),
    Scenario(
        name="frozen",
        description="Rank 1 stops itself (SIGSTOP) before the next collective: "
        "no dump can be taken from it.",
        min_world=2,
        verdict="hang",
        guilty=_rank(1),
        silent=_rank(1),
        in_flight=_all_but(_rank(1)),
    ),
    Scenario(
        name="two",
        description="Rank 1 and the last rank both block before the next collective; "
        "the others wait in it.",
        min_world=3,
        verdict="hang",
        guilty=_two_guilty,
        in_flight=_all_but(_two_guilty),
    ),
    Scenario(
        name="mismatch",
        description="At the next collective rank 2 calls broadcast(src=0) where the others "
        "call all_reduce on a tensor of the same size: gloo hangs (it does not raise).",
        min_world=3,
        verdict="mismatch",
        guilty=_rank(2),
        in_flight=_mismatch_in_flight,
    ),
    Scenario(
        name="subgroup",
        description="The last two ranks form group '1'. The last rank never enters the "
        "subgroup's all_reduce; its partner waits in it; the other ranks then wait in the "
        "default group for both. Only the last rank is guilty.",
        min_world=3,
        verdict="hang",
        guilty=_last_rank,
        groups=_subgroup_groups,
        trains_on=("1",),
        stalled_group="1",
        in_flight=_subgroup_in_flight,
    ),
    Scenario(
        name="order",
        description="Every step does an all_reduce on group '1' (all ranks), then the default "
        "group's collectives. At the faulty step rank 1 enters the default group first: a "
        "cross-group deadlock in which rank 1 is the one out of order. The others wait in "
        "group '1' for it.",
        min_world=3,
        verdict="hang",
        guilty=_rank(1),
        groups=_whole_world_group,
        trains_on=("1",),
        stalled_group="1",
        in_flight=_order_in_flight,
    ),
    Scenario(
        name="wrap",
        description="Like skip (the last rank) but after more collectives than the FR ring "
        "buffer holds (buffer 64, 25 steps = 75 collectives): the oldest entries are gone.",
        min_world=2,
        verdict="hang",
        guilty=_last_rank,
        in_flight=_all_but(_last_rank),
        default_steps=25,
        fr_buffer_size=64,
    ),
    Scenario(
        name="p2p",
        description="Ranks 0 and 1 both recv from each other first (a p2p deadlock); the "
        "others recv from 0 or 1. Gloo records no send/recv in FR, so every dump shows all "
        "collectives completed: the culprit is not visible in FR, only in the stacks (the "
        "coordinator's no-progress rule opens the incident; the recv's src argument, which "
        "the agent's py-spy --locals reads, names the cycle). "
        "(A hook-recorded backend does record the send/recv, but the analyzer's p2p "
        "matching counts sequence numbers and cannot yet pair a recv-recv cycle.)",
        min_world=2,
        verdict="no-culprit-visible",
        guilty=lambda world: (0, 1),
        stalled_group=None,
        fr_visible=False,
        # The coordinator pages an FR-blind hang only after the job made
        # steady progress (detector.STEADY_MOVES moves): ~5 s of training.
        default_steps=16,
        step_time=0.3,
    ),
    Scenario(
        name="healthy",
        description="No fault: a few training steps, a snapshot while every rank is idle "
        "between collectives, then a clean exit 0 on every rank.",
        min_world=1,
        verdict="healthy",
        guilty=_nobody,
        stalled_group=None,
        hooked_verdict="unknown",
    ),
    Scenario(
        name="gil",
        description="Rank 2 calls libc sleep() through ctypes.PyDLL, which keeps the GIL: "
        "no Python thread in that rank runs again, so it writes no dump of its own.",
        min_world=3,
        verdict="hang",
        guilty=_rank(2),
        silent=_rank(2),
        in_flight=_all_but(_rank(2)),
    ),
)

SCENARIOS: dict[str, Scenario] = {s.name: s for s in _SCENARIOS}


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None
