"""Membership and failure detection: each node's local view of who is alive.

Rules
-----
1. Liveness is a *local view*, separate from the owner-signed registry: a crashed node cannot
   sign its own death. Each member has an ``incarnation`` (a counter only its owner raises) and a
   status ALIVE < SUSPECT < DEAD; LEFT comes from the owner's signed LEFT registry entry and is
   final.
2. Records that change the view, and their precedence (SWIM §4.2, as in memberlist):
   - ``Alive(i)``, signed by the owner, wins over anything at an incarnation < i;
   - ``Suspect(i)``, signed by an accuser, wins over ALIVE at incarnation <= i and SUSPECT < i;
   - ``Dead(i)``, signed by an accuser, wins over ALIVE/SUSPECT at incarnation <= i and DEAD < i.
   The order key of a record is therefore ``(incarnation, status)``; anti-entropy compares it.
3. A node that hears itself suspected or declared dead at its incarnation refutes: it raises its
   incarnation and spreads a fresh signed ``Alive``. Nobody else can do that for it.
4. How a silent node's death becomes shared knowledge: a prober whose direct probe *and* k
   indirect probes go unanswered signs ``Suspect``. Every member that learns of the suspicion
   starts a timer (Lifeguard: shorter the more distinct accusers confirm it, from
   ``suspicion_max_s`` down to ``suspicion_min_s``). When its timer fires and no refutation
   arrived, the member probes the suspect itself once more (direct + indirect); only if that
   fails too does it sign ``Dead`` — an *obituary* signed by the accuser — and gossip it. Members
   accept an obituary from any verified cluster member; the accused can overturn it by refuting.
   The extra confirmation probe is what keeps false positives at zero under heavy packet loss:
   a false death now needs a missed refutation *and* a failed probe from the same node.

Theory of operation
-------------------
``MemberTable`` is pure: it holds members, applies records by the rules above and reports what
changed; ``core.MeshCore`` decides what to send. Times are wall-clock seconds passed in.

Every change to a ``Member`` goes through the table (``_own`` first, then ``touch``), which keeps
three small indexes right: the suspects (for timers), the dead or departed (for reconnects and
the sweep) and the ids of reachable members (for picking probe relays, gossip and sync peers),
rebuilt only when a member's reachability flips, not on every incarnation or suspicion. A table
can start from another table's members (``adopt``, for many simulated nodes in one process):
those records are shared and copied on their first write, so a formed cluster of N nodes holds
N member records, not N².
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from fabricnode.mesh.wire import DEAD, Accusation, Alive


class Liveness(enum.IntEnum):
    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3

    @property
    def label(self) -> str:
        return self.name.lower()


NO_RECORD = 3  # liveness code in sync rows for a member we know of only from its entry


@dataclass(slots=True)
class Member:
    session_id: str
    addr: str
    incarnation: int = 0
    status: Liveness = Liveness.ALIVE
    since: float = 0.0
    alive_record: Alive | None = None
    accusation: Accusation | None = None  # the record behind SUSPECT/DEAD
    accusers: frozenset[str] = frozenset()  # replaced, never changed in place
    suspicion_started: float = 0.0
    suspicion_deadline: float = 0.0
    confirming: bool = False
    cleared_suspect_inc: int = -1  # we probed it ourselves and got an answer at this incarnation
    # Table bookkeeping: reachable as of the last touch(); held by other tables too (adopt).
    reach: bool = False
    shared: bool = False

    @property
    def is_reachable(self) -> bool:
        return self.status <= Liveness.SUSPECT and bool(self.addr)

    def liveness_record(self) -> Alive | Accusation | None:
        if self.status in (Liveness.SUSPECT, Liveness.DEAD):
            return self.accusation
        return self.alive_record

    @property
    def sync_code(self) -> int:
        if self.status == Liveness.ALIVE and self.alive_record is None:
            return NO_RECORD
        return min(int(self.status), int(Liveness.DEAD))


class Change(enum.Enum):
    NONE = "none"
    UPDATED = "updated"  # state moved: re-gossip the record
    CONFIRMED = "confirmed"  # another accuser for an existing suspicion
    REFUTE = "refute"  # accusation about ourselves: raise our incarnation


@dataclass(frozen=True)
class SuspicionTiming:
    """Lifeguard's dynamic suspicion timeout (Dadgar et al., §IV-B)."""

    probe_interval_s: float
    suspicion_mult: float
    max_factor: float
    expected_confirmations: int
    floor_s: float = 1.0  # never shorter: rides out a stalled process or a GC pause

    def bounds(self, members: int) -> tuple[float, float]:
        low = self.suspicion_mult * max(1.0, math.log10(max(members, 1))) * self.probe_interval_s
        low = max(low, self.floor_s)
        return low, low * self.max_factor

    def timeout(self, members: int, confirmations: int) -> float:
        low, high = self.bounds(members)
        k = self.expected_confirmations
        if k < 1:
            return low
        frac = math.log(confirmations + 1) / math.log(k + 1)
        return max(low, high - (high - low) * frac)


class MemberTable:
    def __init__(
        self,
        self_id: str,
        timing: SuspicionTiming,
        rng: random.Random,
        on_status: Callable[[str, Liveness, float], None] | None = None,
    ) -> None:
        self.self_id = self_id
        self.on_status = on_status  # observer of status changes (metrics, simulations)
        self.timing = timing
        self.rng = rng
        self.members: dict[str, Member] = {}  # read-only outside this class: write via methods
        self._reachable: list[str] | None = None  # ids; reset when a member's reachability flips
        self._suspects: set[str] = set()
        self._down: set[str] = set()  # DEAD or LEFT
        self._probe_order: list[str] = []
        self._probe_index = 0
        self._all_shared = False  # every member is marked shared (see adopt)

    # -- views ------------------------------------------------------------------------------

    def get(self, sid: str) -> Member | None:
        return self.members.get(sid)

    def status(self, sid: str) -> Liveness | None:
        m = self.members.get(sid)
        return None if m is None else m.status

    def touch(self, m: Member) -> None:
        """Record that a member's status or address changed (keeps the indexes right)."""
        reach = m.is_reachable
        if reach != m.reach:
            m.reach = reach
            self._reachable = None
        if self.on_status is not None:
            self.on_status(m.session_id, m.status, m.since)
        current = self.members.get(m.session_id) is m
        sid = m.session_id
        if m.status == Liveness.SUSPECT and current:
            self._suspects.add(sid)
        else:
            self._suspects.discard(sid)
        if m.status >= Liveness.DEAD and current:
            self._down.add(sid)
        else:
            self._down.discard(sid)

    def live_count(self) -> int:
        """Members (self included) not known dead or gone: the N of all timing formulas."""
        return 1 + len(self._reachable_ids())

    def has_reachable(self) -> bool:
        return bool(self._reachable_ids())

    def _reachable_ids(self) -> list[str]:
        if self._reachable is None:
            self._reachable = [sid for sid, m in self.members.items() if m.reach]
        return self._reachable

    def reachable(self, exclude: tuple[str, ...] = ()) -> list[Member]:
        members = self.members
        return [members[sid] for sid in self._reachable_ids() if sid not in exclude]

    def random_reachable(self, k: int, exclude: tuple[str, ...] = ()) -> list[Member]:
        pool = self._reachable_ids()
        members = self.members
        if len(pool) <= k + len(exclude):
            return [members[sid] for sid in pool if sid not in exclude][:k]
        picked: list[Member] = []
        for sid in self.rng.sample(pool, k + len(exclude)):
            if sid not in exclude and len(picked) < k:
                picked.append(members[sid])
        return picked

    def dead_members(self) -> list[Member]:
        members = self.members
        down = (members[sid] for sid in sorted(self._down))  # sorted: seeded runs repeat
        return [m for m in down if m.status == Liveness.DEAD and m.addr]

    def down_members(self) -> list[Member]:
        """Members known dead or departed (what the sweep of long-gone members looks at)."""
        return [self.members[sid] for sid in sorted(self._down)]

    def next_probe_target(self) -> Member | None:
        """Randomised round robin (SWIM §4.3): every member probed once per pass."""
        for _ in range(2):
            while self._probe_index < len(self._probe_order):
                sid = self._probe_order[self._probe_index]
                self._probe_index += 1
                m = self.members.get(sid)
                if m is not None and m.reach:
                    return m
            self._probe_order = list(self.members)
            self.rng.shuffle(self._probe_order)
            self._probe_index = 0
        return None

    # -- sharing ------------------------------------------------------------------------------

    def adopt(self, source: MemberTable) -> None:
        """Start from ``source``'s view of every member but ourselves.

        For simulations of a formed cluster in one process: the records are shared with
        ``source`` (and with every other table that adopted them) and each table copies one
        on its first write (``_own``), so N tables over N members hold N records plus their
        dicts, not N² records.
        """
        if not source._all_shared:
            for m in source.members.values():
                m.shared = True
            source._all_shared = True
        if self.members:
            for sid, m in source.members.items():
                if sid != self.self_id and sid not in self.members:
                    self.members[sid] = m
        else:
            self.members = dict(source.members)
            self.members.pop(self.self_id, None)
        self._reachable = None
        self._suspects.update(sid for sid in source._suspects if sid in self.members)
        self._down.update(sid for sid in source._down if sid in self.members)

    def _own(self, m: Member) -> Member:
        """The member, made ours to change (a private copy of a shared record)."""
        if not m.shared:
            return m
        mine = replace(m, shared=False)
        self.members[m.session_id] = mine
        self._all_shared = False
        return mine

    # -- learning about members ---------------------------------------------------------------

    def learn_address(self, sid: str, addr: str, now: float) -> Member:
        """A member known from its registry entry (no liveness record yet)."""
        m = self.members.get(sid)
        if m is None:
            m = Member(sid, addr, since=now)
            self.members[sid] = m
            self._all_shared = False
            self.touch(m)
            # New members go to a random place of the current pass so they get probed soon.
            self._probe_order.insert(
                self.rng.randint(self._probe_index, len(self._probe_order)), sid
            )
        elif not m.addr:
            m = self._own(m)
            m.addr = addr
            self.touch(m)
        return m

    def apply_alive(self, rec: Alive, now: float) -> Change:
        if rec.session_id == self.self_id:
            return Change.NONE
        m = self.members.get(rec.session_id)
        if m is None:
            m = self.learn_address(rec.session_id, rec.gossip_addr, now)
        elif (
            m.status == Liveness.LEFT
            or (m.alive_record is not None and rec.incarnation <= m.incarnation)
            or (m.status != Liveness.ALIVE and rec.incarnation <= m.incarnation)
        ):
            return Change.NONE
        m = self._own(m)
        m.incarnation = rec.incarnation
        m.alive_record = rec
        m.addr = rec.gossip_addr
        if m.status != Liveness.ALIVE:
            m.since = now
        m.status = Liveness.ALIVE
        m.accusation = None
        m.accusers = frozenset()
        m.confirming = False
        self.touch(m)
        return Change.UPDATED

    def apply_accusation(self, rec: Accusation, now: float, addr_hint: str = "") -> Change:
        if rec.target == self.self_id:
            return Change.REFUTE
        m = self.members.get(rec.target)
        if m is None:
            m = self.learn_address(rec.target, addr_hint, now)
            m.incarnation = rec.incarnation
        if m.status == Liveness.LEFT:
            return Change.NONE
        if rec.kind == DEAD:
            if m.status == Liveness.DEAD and rec.incarnation <= m.incarnation:
                return Change.NONE
            if rec.incarnation < m.incarnation:
                return Change.NONE
            m = self._own(m)
            m.status = Liveness.DEAD
            m.incarnation = rec.incarnation
            m.accusation = rec
            m.since = now
            m.confirming = False
            self.touch(m)
            return Change.UPDATED
        # SUSPECT
        if rec.incarnation < m.incarnation or m.status == Liveness.DEAD:
            return Change.NONE
        if m.status == Liveness.SUSPECT and rec.incarnation == m.incarnation:
            if rec.accuser in m.accusers:
                return Change.NONE
            m = self._own(m)
            m.accusers = m.accusers | {rec.accuser}
            self._reset_deadline(m)
            return Change.CONFIRMED
        if rec.incarnation <= m.cleared_suspect_inc:
            return Change.NONE
        m = self._own(m)
        m.status = Liveness.SUSPECT
        m.incarnation = rec.incarnation
        m.accusation = rec
        m.accusers = frozenset((rec.accuser,))
        m.since = now
        m.suspicion_started = now
        m.confirming = False
        self._reset_deadline(m)
        self.touch(m)
        return Change.UPDATED

    def _reset_deadline(self, m: Member) -> None:
        timeout = self.timing.timeout(self.live_count(), len(m.accusers) - 1)
        m.suspicion_deadline = m.suspicion_started + timeout

    def clear_suspicion(self, sid: str, now: float) -> None:
        """We reached a suspect ourselves: alive locally, at the same incarnation."""
        m = self.members.get(sid)
        if m is None or m.status != Liveness.SUSPECT:
            return
        m = self._own(m)
        m.status = Liveness.ALIVE
        m.cleared_suspect_inc = m.incarnation
        m.accusation = None
        m.accusers = frozenset()
        m.confirming = False
        m.since = now
        self.touch(m)

    def mark_left(self, sid: str, now: float) -> bool:
        m = self.members.get(sid)
        if m is None or m.status == Liveness.LEFT:
            return False
        m = self._own(m)
        m.status = Liveness.LEFT
        m.since = now
        m.confirming = False
        self.touch(m)
        return True

    def remove(self, sid: str) -> None:
        m = self.members.pop(sid, None)
        self._suspects.discard(sid)
        self._down.discard(sid)
        if m is not None and m.reach:
            self._reachable = None

    def expired_suspicions(self, now: float) -> list[Member]:
        """Suspects whose timer ran out and whose confirmation has not started: the caller
        confirms each (``start_confirming``)."""
        suspects = [self.members[sid] for sid in self._suspects]
        return [m for m in suspects if not m.confirming and now >= m.suspicion_deadline]

    def start_confirming(self, m: Member) -> Member:
        """Stop the suspicion timer of ``m``: its confirmation probe is under way."""
        m = self._own(m)
        m.confirming = True
        return m

    def next_suspicion_deadline(self) -> float | None:
        times = [
            self.members[sid].suspicion_deadline
            for sid in self._suspects
            if not self.members[sid].confirming
        ]
        return min(times) if times else None
