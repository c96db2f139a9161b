"""The batch gate: where batch requests wait for a node with room for batch work, as a sans-IO
machine (h11's ``Connection``, aioquic's loss recovery): requests and ``now`` in, verdicts and
a deadline out. The ingress (its shell) holds the waiting tasks and their wake-ups; every
decision is here.

Rules
-----
1. ``offer(waiter, now, wall)``: a batch request that wants a node. ``GO`` when it may go at
   once: a node has room (``tiers.has_room``, pacing, no prompt of ours still ahead on the
   node's prefill clock) and nobody waits, or it is a failover (an admitted request keeps its
   turn); its ranked candidates are ``waiter.ranked`` and the first holds a batch slot
   (``job.slot.node``). ``QUEUED``: it waits in its tenant's queue (``tiers.FairQueue``) and
   may already be granted (``waiter.outcome``). ``REFUSED``: ``GATE_FULL`` (the gate is full
   and the tenant's queue is the longest) or ``NO_NODE`` (no eligible node at all).
2. ``scan(now, wall)`` releases the waiters that can go now in fair order (``tiers``' theory of
   operation): each with room is granted; once one finds none, the rest of its group (the same
   filters: the same nodes) are passed over. ``expire(now)`` ends the waits past their
   deadline (``GATE_TIMEOUT``: ``batch_max_wait_s`` from the request's arrival, or from its
   failover); ``leave(waiter, outcome)`` one whose client went (``GATE_GONE``).
3. ``done(job)``: an attempt that held a batch slot ended; its slot is free (and the shell
   scans: a waiter may have it).
4. ``pressure(now, wall)``: the batch attempts to take back (yielding under pressure): on each
   node whose fresh load report, newer than the one its last preemption answered, shows a queue
   longer than ``batch_max_waiting`` with the KV cache at ``batch_preempt_kv_threshold`` or
   more, our newest attempts with no answer yet, one per queued request, at most
   ``batch_preempt_per_report``. An attempt is preemptible from ``running(job, sid, now)``
   until ``answered(job, sid)`` (its answer's head is in).
5. ``next_deadline()``: the earliest loop-clock time at which the machine's answer may change
   by time alone: a waiter's deadline, or, for a waiter that found no room, the soonest of the
   node's pacing end, the end of its prefill clock and the moment a load report that denied
   room goes stale (a node without a fresh report takes one request). Anything else that gives
   room is an event the shell reports by scanning: a batch attempt ending, a load report
   arriving, a node joining. ``math.inf``: nothing waits.
6. Every waiter whose wait ended (granted, refused, timed out, gone, pushed out) is handed to
   the shell once by ``take_ended()``, with ``waiter.outcome`` set; ``scan`` and ``expire``
   change the queue only after their walk.

Pure: no I/O, no clock reads, no trio; ``now`` is the ingress's monotonic clock, ``wall`` the
wall clock load reports carry. The world is read through ``lookup`` (a waiter's routes and its
eligible candidates, from the shell's route table and filters) and ``load_of`` (a node's last
load report); ranking among the nodes with room is the routing policy's (never a hold).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable

from fabricnode.dataplane.job import BatchSlot, Job
from fabricnode.dataplane.prefill import PrefillClocks
from fabricnode.dataplane.request import Rejection, Routed
from fabricnode.dataplane.routetable import Route
from fabricnode.dataplane.routing import Candidate, LoadSnapshot, Policy
from fabricnode.dataplane.tiers import (
    NO_TENANT,
    PRIORITY_KINDS,
    FairQueue,
    RoomRules,
    Ticket,
    has_room,
    next_paced,
)

# ``offer``'s verdicts.
GO = "go"
QUEUED = "queued"
REFUSED = "refused"
# How a batch request's wait in the gate ended (``BatchWaiter.outcome``); the refusals are the
# error codes the client gets.
GRANTED = "granted"
GATE_FULL = "batch_queue_full"
GATE_TIMEOUT = "batch_wait_timeout"
GATE_GONE = "gone"
NO_NODE = "no_node"
MAX_KEY_LABELS = 256  # distinct ``key`` labels of the batch metrics (tenants without a key)
RETRY_AFTER_S = 5  # Retry-After of a batch request refused (gate full, waited too long)

# A waiter's routes and eligible candidates now (its tried nodes left out), or None when it has
# none: ``(waiter, now, wall)``.
Lookup = Callable[["BatchWaiter", float, float], "tuple[list[Route], list[Candidate]] | None"]


class BatchWaiter:
    """A batch request at the gate, and how its wait ended."""

    __slots__ = (
        "deadline",
        "first",
        "job",
        "label",
        "outcome",
        "ranked",
        "routed",
        "routes",
        "slot",
        "ticket",
        "tried",
    )

    def __init__(
        self,
        job: Job,
        routed: Routed,
        tried: set[str],
    ) -> None:
        self.job = job
        slot = job.slot
        if slot is None:
            raise ValueError("only a batch request (one with a BatchSlot) waits at the gate")
        self.slot: BatchSlot = slot
        self.routed = routed  # the request as decoded: its filters and its pin
        self.tried = tried  # nodes this request tried already (a failover)
        self.first = not tried  # its first admission (not a failover): counted in the metrics
        self.deadline = math.inf
        self.label = ""  # its ``key`` label in the metrics
        self.outcome = ""  # GRANTED, GATE_FULL, ... once its wait is over
        self.ranked: list[Candidate] = []  # granted: the nodes to try, in order
        self.routes: list[Route] = []  # ... and the routes they come from
        self.ticket: Ticket[BatchWaiter] | None = None

    def group(self) -> Hashable:
        """Waiters with the same filters see the same nodes (``tiers``' groups)."""
        r = self.routed
        return (r.model, r.providers, r.requirements, r.sites, r.pinned)


class BatchGate:
    """The batch gate's state and policy (see the module docstring)."""

    def __init__(
        self,
        *,
        max_waiting: int,
        max_wait_s: float,
        rules: RoomRules,
        prefill_tokens_per_s: float,
        preempt_kv_threshold: float,
        preempt_per_report: int,
        policy: Policy,
        prefill: PrefillClocks,
        lookup: Lookup,
        load_of: Callable[[str], LoadSnapshot | None],
    ) -> None:
        self.queue: FairQueue[BatchWaiter] = FairQueue(max_waiting)
        self.max_wait_s = max_wait_s
        self.rules = rules
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.preempt_kv_threshold = preempt_kv_threshold
        self.preempt_per_report = preempt_per_report
        self.policy = policy
        self.prefill = prefill
        self.lookup = lookup
        self.load_of = load_of
        # Our batch requests in flight per node (a slot is taken when one is admitted, given
        # back by ``done``), and of those, the ones that carry vLLM's priority field where the
        # node schedules by it (``tiers.PRIORITY_KINDS``): hidden from interactive scores.
        self.inflight: dict[str, int] = {}
        self.hidden: dict[str, int] = {}
        # Pacing (``batch_prefill_tokens_per_s``): when each node may take its next request.
        self.paced_until: dict[str, float] = {}
        # Attempts that may be taken back, by node: job -> when it was sent. And the load report
        # (its time) each node's last preemption answered: the next waits for a newer one.
        self.preemptible: dict[str, dict[Job, float]] = {}
        self._preempted_report: dict[str, float] = {}
        self._ended: list[BatchWaiter] = []
        self._retry_at = math.inf  # when a node that had no room may have some, by time alone
        self._key_labels: set[str] = set()

    def __len__(self) -> int:
        return len(self.queue)

    def waiters(self) -> list[BatchWaiter]:
        return [ticket.item for ticket in self.queue]

    def busy(self) -> bool:
        """Whether the shell has anything to watch: waiters, or attempts it may take back."""
        return len(self.queue) > 0 or bool(self.preemptible)

    # -- admission ----------------------------------------------------------------------------

    def offer(self, w: BatchWaiter, now: float, wall: float) -> str:
        """A batch request that wants a node: ``GO``, ``QUEUED`` or ``REFUSED`` (rule 1)."""
        queue = self.queue
        if not w.first or not len(queue):
            got = self._try(w, now, wall)
            if got is None:
                w.outcome = NO_NODE
                return REFUSED
            if got:
                w.outcome = GRANTED
                return GO
        w.label = self.key_label(w.job)
        key = w.job.key
        ticket, pushed_out = queue.push(w.slot.tenant, key.weight if key else 1.0, w.group(), w)
        if pushed_out is not None:  # a longer queue's newest made room for this tenant
            self._end(pushed_out.item, GATE_FULL)
        if ticket is None:
            w.outcome = GATE_FULL
            return REFUSED
        w.ticket = ticket
        w.deadline = (w.job.started if w.first else now) + self.max_wait_s
        self.scan(now, wall)  # its turn may be now (another tenant's, or no room elsewhere)
        return QUEUED

    def scan(self, now: float, wall: float) -> None:
        """Release the waiters that can go now, in fair order (rule 2)."""
        queue = self.queue
        self._retry_at = math.inf
        if not len(queue):
            return
        groups = queue.groups()
        blocked: set[Hashable] = set()
        ended: list[tuple[Ticket[BatchWaiter], str]] = []
        for ticket in queue.ordered():
            group = ticket.group
            if group in blocked:
                continue
            w = ticket.item
            got = self._try(w, now, wall)
            if got is None:
                ended.append((ticket, NO_NODE))
            elif got:
                ended.append((ticket, GRANTED))
            elif not w.tried:  # a failover sees fewer nodes than its group: it proves nothing
                blocked.add(group)
                if len(blocked) >= groups:
                    break
        for ticket, outcome in ended:  # the queue changes only after the walk
            if outcome == GRANTED:
                queue.grant(ticket)
            else:
                queue.cancel(ticket)
            self._end(ticket.item, outcome)

    def expire(self, now: float) -> None:
        """End the waits past their deadline (``GATE_TIMEOUT``)."""
        late = [ticket for ticket in self.queue if now >= ticket.item.deadline]
        for ticket in late:
            self.queue.cancel(ticket)
            self._end(ticket.item, GATE_TIMEOUT)

    def leave(self, w: BatchWaiter, outcome: str = GATE_GONE) -> None:
        """``w`` leaves the gate before its turn (its client went; shutdown): a no-op once its
        wait ended."""
        if w.ticket is not None and w.ticket.live:
            self.queue.cancel(w.ticket)
            self._end(w, outcome)

    def refusal(self, outcome: str) -> Rejection:
        """The 503 a request the gate sent away (``GATE_FULL``, ``GATE_TIMEOUT``) gets."""
        if outcome == GATE_FULL:
            message = (
                f"{len(self.queue)} batch requests wait at this ingress, its most: retry later"
            )
        else:
            message = f"no node had room for batch work within {self.max_wait_s:g} s: retry later"
        return Rejection(503, message, outcome, [(b"retry-after", b"%d" % RETRY_AFTER_S)])

    def take_ended(self) -> list[BatchWaiter]:
        """The waiters whose wait ended since the last call, each once (``outcome`` set)."""
        ended, self._ended = self._ended, []
        return ended

    def next_deadline(self) -> float:
        """When the machine's answer may change by time alone (rule 5); ``math.inf``: never."""
        if not len(self.queue):
            return math.inf
        soonest = self._retry_at
        for ticket in self.queue:
            soonest = min(soonest, ticket.item.deadline)
        return soonest

    def _end(self, w: BatchWaiter, outcome: str) -> None:
        w.outcome = outcome
        self._ended.append(w)

    def _try(self, w: BatchWaiter, now: float, wall: float) -> bool | None:
        """Admit ``w`` if an eligible node has room for batch work: rank those nodes with the
        policy (no hold), take a batch slot on the first. True if admitted, False if no node
        has room (noting when one may have some, by time), None if no node is eligible."""
        found = self.lookup(w, now, wall)
        if found is None:
            return None
        routes, cands = found
        if not cands:
            return None
        inflight = self.inflight
        rules = self.rules
        paced = self.paced_until
        roomy: list[Candidate] = []
        for c in cands:
            sid = c.node.session_id
            n = inflight.get(sid, 0)
            until = paced.get(sid, 0.0)
            # One prompt at a time: a node whose prefill clock shows prompts still ahead takes
            # no batch request, so batch prompts never pile into one long engine step.
            if has_room(c.load, n, wall, rules) and until <= now and c.prefill_s <= 0.0:
                roomy.append(c)
            else:
                self._note_retry(c, n, until, now, wall)
        if not roomy:
            return False
        job = w.job
        ranked: list[Candidate] | None = None
        if len(roomy) > 1 and not job.waking:
            ranked = self.policy.rank(w.routed, roomy, wall, allow_hold=False)
        w.ranked = ranked or roomy
        w.routes = routes
        sid = w.ranked[0].node.session_id
        self._book(w, sid, now)
        return True

    def _note_retry(self, c: Candidate, n: int, until: float, now: float, wall: float) -> None:
        """A node without room: when time alone may give it some (``next_deadline``): once its
        pacing and its prefill clock have run out, and its load report allows one (now, or
        once a fresh report that denies room goes stale and nothing of ours runs there)."""
        load = c.load
        rules = self.rules
        if has_room(load, n, wall, rules):
            at = now
        elif n < 1 and load is not None and abs(wall - load.at) <= rules.stale_after_s:
            at = now + (load.at + rules.stale_after_s - wall)
        else:
            return  # only an event gives it room: a report, a batch attempt ending
        at = max(at, until, now + c.prefill_s)
        if at < self._retry_at:
            self._retry_at = at

    def _book(self, w: BatchWaiter, sid: str, now: float) -> None:
        """``w`` goes to ``sid``: its batch slot, its prompt on the node's prefill clock, and
        the node's next pacing time."""
        job = w.job
        inflight = self.inflight
        inflight[sid] = inflight.get(sid, 0) + 1
        if job.kind in PRIORITY_KINDS:
            self.hidden[sid] = self.hidden.get(sid, 0) + 1
        slot = w.slot
        slot.node = sid
        if job.prefill_tokens:
            # On the clock now, not when its task gets to send it: the same walk of the gate
            # must see this node busy, or it sends it several batch prompts at once.
            self.prefill.sent(sid, job.prefill_tokens, now, True)
            slot.booked = sid
        rate = self.prefill_tokens_per_s
        if rate > 0:
            paced = self.paced_until
            paced[sid] = next_paced(paced.get(sid, now), now, w.routed.prompt_tokens_est, rate)

    def done(self, job: Job) -> None:
        """The attempt that held a batch slot ended: its slot is free (rule 3)."""
        slot = job.slot
        if slot is None or slot.node is None:
            return
        sid = slot.node
        slot.node = None
        _take_one(self.inflight, sid)
        if job.kind in PRIORITY_KINDS:
            _take_one(self.hidden, sid)

    # -- yielding under pressure --------------------------------------------------------------

    def running(self, job: Job, sid: str, now: float) -> None:
        """A batch attempt on ``sid`` that may be taken back until ``answered``."""
        self.preemptible.setdefault(sid, {})[job] = now

    def answered(self, job: Job, sid: str) -> None:
        """Its answer's head is in (or it ended): it runs to the end."""
        running = self.preemptible.get(sid)
        if running is not None and running.pop(job, None) is not None and not running:
            del self.preemptible[sid]

    def pressure(self, wall: float) -> list[Job]:
        """The attempts to take back now (rule 4); the shell cancels them and calls
        ``answered`` for each."""
        threshold = self.preempt_kv_threshold
        if threshold >= 1.0 or not self.preemptible:
            return []
        rules = self.rules
        taken: list[Job] = []
        for sid, running in self.preemptible.items():
            load = self.load_of(sid)
            if load is None or not abs(wall - load.at) <= rules.stale_after_s:
                continue
            if load.waiting <= rules.max_waiting or not load.kv_usage >= threshold:
                continue
            if load.at <= self._preempted_report.get(sid, -math.inf):
                continue  # the report the last preemption answered: wait for a newer one
            self._preempted_report[sid] = load.at
            n = min(load.waiting, self.preempt_per_report)
            newest = sorted(running.items(), key=_sent_at, reverse=True)[:n]
            taken.extend(job for job, _ in newest)
        return taken

    def forget(self, sid: str) -> None:
        """Node ``sid`` left the routing table."""
        self.paced_until.pop(sid, None)
        self._preempted_report.pop(sid, None)

    # -- metrics ------------------------------------------------------------------------------

    def key_label(self, job: Job) -> str:
        """The ``key`` label of a batch request: its key's name, else its tenant (at most
        ``MAX_KEY_LABELS`` tenants without a key get their own, the rest ``other``)."""
        key = job.key
        slot = job.slot
        label = key.name if key is not None else slot.tenant if slot is not None else NO_TENANT
        labels = self._key_labels
        if label not in labels:
            if len(labels) >= MAX_KEY_LABELS:
                return "other"
            labels.add(label)
        return label

    def waiting_by_label(self) -> dict[str, int]:
        waiting: dict[str, int] = {}
        for ticket in self.queue:
            label = ticket.item.label
            waiting[label] = waiting.get(label, 0) + 1
        return waiting


def _sent_at(item: tuple[Job, float]) -> float:
    return item[1]


def _take_one(counts: dict[str, int], key: str) -> None:
    """One fewer for ``key``, whose entry goes at zero (the dict holds only non-zero counts)."""
    n = counts.get(key, 1) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)
