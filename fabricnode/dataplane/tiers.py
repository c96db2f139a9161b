"""Priority tiers at the ingress: interactive and batch requests, the room a node has for batch
work, and the fair share of that room between API keys (SageServe's tiers, with start-time
fair queueing between tenants).

Rules
-----
1. Every request has a tier: ``interactive`` (the default) or ``batch``. A request is batch
   when its ``X-Fabric-Priority`` header says so (``interactive`` | ``batch``, any case; any
   other value is a 400 ``invalid_header``), or when it carries this agent's batch owner header
   (``x-fabric-batch-owner: <token> <tenant>``: the agent's own Batch API worker, which holds
   the token the agent made at start). Neither header is ever forwarded upstream.
2. Only batch requests are ever held here. An interactive request pays two header lookups and
   is routed as before: it never waits behind a batch one at the ingress.
3. A batch request goes to a node only while that node has room for batch work (``has_room``): a
   fresh gossiped load report (``routing``'s ``load_stale_after_s``) with ``waiting <=
   max_waiting`` and ``kv_usage < kv_threshold`` (0.7 by default; SageServe's 60%), and this
   ingress's batch requests in flight to it below ``max_inflight``; a node whose report is missing
   or stale takes at most one. Batch in-flight counts are the ingress's own, apart from the counts
   the policies see, and a request's own node (its local engine) counts the same way.
4. Batch requests that find no node with room wait in the gate, queued per *tenant* (the API
   key's id; ``-`` when keys are off, or the tenant the owner header names), and are released
   in weighted fair order (``FairQueue``): while tenants are backlogged, each is released in
   proportion to its weight, whatever it offers.
5. Bounded: at most ``max_waiting`` waiters in all. A full gate makes room for a tenant with
   fewer waiters than the longest queue by pushing out that queue's newest waiter (longest
   queue drop); otherwise the newcomer is refused. A tenant is tracked only while it has
   waiters, so tenants never outnumber waiters.
6. Pure: no I/O, no clock, no trio. The ingress (its shell) holds the waiting tasks, decides
   when to look for room, and calls ``ordered`` / ``grant`` / ``cancel``.

Theory of operation
-------------------
``FairQueue`` is start-time fair queueing (Goyal, Vin and Cheng, SIGCOMM '96) with one request
as the unit of work. The queue keeps a virtual time ``V``, the start tag of the last request
released. A request of tenant ``t`` (weight ``w``) arriving gets the start tag
``max(V, finish[t])`` and moves ``finish[t]`` to that tag plus ``1/w``; requests are released
in start-tag order (arrival breaks ties). Two tenants that are both backlogged are therefore
released alternately at equal weights, or 2:1 at weights 2:1, however many requests each has
queued: a tenant offering ten times the load of another only queues deeper. A tenant that was
idle starts at ``V``: it gets no credit for its idle time, and no debt either (its state is
forgotten once it has no waiter). A waiter that leaves early keeps the tags of its tenant's
later waiters as they were, a small cost to that tenant only; the newest one leaving rolls its
tenant's ``finish`` back.

Requests also differ in where they may go (model, provider and requirement filters), so the
first waiter in fair order may have no room while a later one does on other nodes. The shell
walks the waiters in fair order (``ordered``, a merge of the tenants' queues) and releases each
that has room, passing over the ones that have none; waiters share a *group* (their routing
filters), and once a group has no room the rest of its waiters are skipped, and the walk ends
when every group with waiters has none. ``grant`` is called after the walk, never during it.
"""

from __future__ import annotations

import hmac
import math
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from heapq import merge
from typing import Generic, TypeVar

import orjson

from fabricnode.dataplane.endpoints import CHAT, COMPLETIONS, RESPONSES
from fabricnode.dataplane.keytable import ApiKey, KeyTable
from fabricnode.dataplane.request import BATCH as BATCH
from fabricnode.dataplane.request import INTERACTIVE as INTERACTIVE
from fabricnode.dataplane.request import NO_TENANT as NO_TENANT
from fabricnode.dataplane.request import PRIORITY_HEADER as PRIORITY_HEADER
from fabricnode.dataplane.request import TIERS as TIERS
from fabricnode.dataplane.request import Rejection
from fabricnode.dataplane.request import tier_of as tier_of
from fabricnode.dataplane.routing import LoadSnapshot

# The tier header's grammar (``tier_of``) is the decoder's, which reads it once per request.
OWNER_HEADER = b"x-fabric-batch-owner"
MAX_TENANT_CHARS = 64
# The kinds whose JSON body carries vLLM's ``priority`` field to an engine that schedules by it
# (``--scheduling-policy priority``): the OpenAI generation requests.
PRIORITY_KINDS = frozenset((CHAT, COMPLETIONS, RESPONSES))

T = TypeVar("T")


# -- the headers --------------------------------------------------------------------------------


def valid_tenant(tenant: str) -> bool:
    """A tenant name an owner header may give: 1-64 printable ASCII characters, no space."""
    return (
        0 < len(tenant) <= MAX_TENANT_CHARS
        and tenant.isascii()
        and tenant.isprintable()
        and " " not in tenant
    )


OWNER_REJECTION = Rejection(
    401,
    "the batch owner header (x-fabric-batch-owner: TOKEN TENANT) does not verify",
    "invalid_batch_owner",
)


def owner_of(
    raw: bytes, token: str | None, keys: KeyTable | None
) -> tuple[ApiKey | None, str] | Rejection:
    """The API key (None when keys are off) and tenant an owner header speaks for, or its 401.

    The header is ``<token> <tenant>``; the token must be ``token`` (compared in constant time;
    no token: nothing verifies). With keys on the tenant is an API key's id and must name an
    active key (the request gets that key's provider allowlist, but not its rate limit: the
    gate governs batch work); with keys off it names the fair-share tenant (``-``: none).
    """
    given, _, tenant = raw.decode("latin-1").strip().partition(" ")
    tenant = tenant.strip()
    expected = (token or "").encode()
    if not hmac.compare_digest(given.encode("latin-1"), expected) or not token:
        return OWNER_REJECTION
    if not valid_tenant(tenant):
        return OWNER_REJECTION
    if keys is None or not keys.enabled:
        return None, tenant
    key = keys.get(tenant)
    if key is None or key.disabled:
        return Rejection(
            401,
            f"the batch owner header names {tenant[:16]!r}, which is no active API key id",
            "invalid_api_key",
        )
    return key, tenant


# -- room for batch work ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoomRules:
    """When a node has room for batch work (``has_room``); from ``IngressConfig``."""

    kv_threshold: float = 0.7  # batch_kv_threshold: KV usage below this
    max_waiting: int = 0  # batch_max_waiting: the node's queue at most this long
    max_inflight: int = 32  # batch_max_inflight_per_node: our batch requests in flight to it
    stale_after_s: float = 3.0  # routing's load_stale_after_s: a report older is not trusted


def has_room(load: LoadSnapshot | None, inflight: int, now: float, rules: RoomRules) -> bool:
    """May one more batch request go to a node whose last report is ``load`` and to which this
    ingress has ``inflight`` batch requests? ``now`` is the wall clock (reports carry the
    reporting node's). Without a fresh report at most one goes (NaN times are not fresh)."""
    if load is None or not abs(now - load.at) <= rules.stale_after_s:
        return inflight < 1
    return (
        inflight < rules.max_inflight
        and load.waiting <= rules.max_waiting
        and load.kv_usage < rules.kv_threshold
    )


def next_paced(until: float, now: float, tokens: int, rate_per_s: float) -> float:
    """Pacing: when a node that may take batch work from ``until`` on, and is sent a request of
    ``tokens`` prompt tokens at ``now``, may take the next one. No credit for idle time: the
    delay counts from ``now`` if ``until`` has passed, so a node never gets a burst of batch
    prefills at once."""
    return max(until, now) + max(tokens, 1) / rate_per_s


# -- fair queueing between tenants --------------------------------------------------------------


class Ticket(Generic[T]):
    """One waiting request in a ``FairQueue``."""

    __slots__ = ("group", "item", "live", "seq", "tag", "tenant")

    def __init__(self, tenant: str, tag: float, seq: int, group: Hashable, item: T) -> None:
        self.tenant = tenant
        self.tag = tag  # its start tag: released in (tag, seq) order
        self.seq = seq
        self.group = group  # waiters of one group have the same candidates (the shell's)
        self.item = item
        self.live = True  # waiting: not granted, cancelled or pushed out


def _order(ticket: Ticket[T]) -> tuple[float, int]:
    return ticket.tag, ticket.seq


class _Tenant(Generic[T]):
    __slots__ = ("finish", "live", "queue")

    def __init__(self, finish: float) -> None:
        self.finish = finish  # the finish tag of its last request queued
        self.queue: deque[Ticket[T]] = deque()  # in tag order; dead tickets removed lazily
        self.live = 0


@dataclass(frozen=True)
class FairQueueStatistics:
    waiting: int
    tenants: int
    pushed: int  # waiters ever queued
    granted: int
    cancelled: int
    refused: int  # refused because the queue was full
    pushed_out: int  # dropped to make room for a shorter queue's newcomer


class FairQueue(Generic[T]):
    """Waiters per tenant, released by weighted start-time fair queueing (module docstring)."""

    def __init__(self, max_waiting: int) -> None:
        if max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        self.max_waiting = max_waiting
        self.virtual = 0.0  # V: the start tag of the last waiter granted
        self._tenants: dict[str, _Tenant[T]] = {}
        self._groups: dict[Hashable, int] = {}  # live waiters per group
        self._live = 0
        self._seq = 0
        self._pushed = 0
        self._granted = 0
        self._cancelled = 0
        self._refused = 0
        self._pushed_out = 0

    def __len__(self) -> int:
        return self._live

    def groups(self) -> int:
        """How many groups have waiters."""
        return len(self._groups)

    def push(
        self, tenant: str, weight: float, group: Hashable, item: T
    ) -> tuple[Ticket[T] | None, Ticket[T] | None]:
        """Queue ``item`` for ``tenant`` (``weight`` > 0): ``(its ticket, the waiter pushed out
        to make room)``; ``(None, None)`` when the queue is full and ``tenant`` already has as
        many waiters as the longest queue."""
        pushed_out: Ticket[T] | None = None
        if self._live >= self.max_waiting:
            pushed_out = self._push_out(tenant)
            if pushed_out is None:
                self._refused += 1
                return None, None
        if not (weight > 0 and math.isfinite(weight)):
            weight = 1.0
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(self.virtual)
        start = max(self.virtual, state.finish)
        state.finish = start + 1.0 / weight
        self._seq += 1
        ticket = Ticket(tenant, start, self._seq, group, item)
        state.queue.append(ticket)
        state.live += 1
        self._live += 1
        self._groups[group] = self._groups.get(group, 0) + 1
        self._pushed += 1
        return ticket, pushed_out

    def _push_out(self, tenant: str) -> Ticket[T] | None:
        """The full queue's answer to a newcomer of ``tenant``: the newest waiter of the longest
        queue, dropped, if that queue is longer than ``tenant``'s."""
        own = self._tenants.get(tenant)
        longest: _Tenant[T] | None = None
        for state in self._tenants.values():
            if longest is None or state.live > longest.live:
                longest = state
        if longest is None or longest.live <= (own.live if own is not None else 0) + 1:
            return None
        while longest.queue and not longest.queue[-1].live:
            longest.queue.pop()
        victim = longest.queue[-1]
        self._drop(victim, rollback=True)
        self._pushed_out += 1
        return victim

    def ordered(self) -> Iterator[Ticket[T]]:
        """The waiters in release order. Do not push, grant or cancel while iterating."""
        queues = [state.queue for state in self._tenants.values()]
        if len(queues) == 1:
            return (t for t in queues[0] if t.live)
        return (t for t in merge(*queues, key=_order) if t.live)

    def __iter__(self) -> Iterator[Ticket[T]]:
        """The waiters, in no particular order (same caveat as ``ordered``)."""
        for state in self._tenants.values():
            for ticket in state.queue:
                if ticket.live:
                    yield ticket

    def waiting_of(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return state.live if state is not None else 0

    def grant(self, ticket: Ticket[T]) -> None:
        """Release ``ticket``: virtual time moves to its start tag."""
        if not ticket.live:
            return
        self.virtual = max(self.virtual, ticket.tag)
        self._drop(ticket, rollback=False)
        self._granted += 1

    def cancel(self, ticket: Ticket[T]) -> None:
        """``ticket``'s request left before it was released (its client went, it timed out)."""
        if not ticket.live:
            return
        self._drop(ticket, rollback=True)
        self._cancelled += 1

    def _drop(self, ticket: Ticket[T], *, rollback: bool) -> None:
        """Take ``ticket`` out; ``rollback``: it was never served, so if it was its tenant's
        newest, the tenant's finish tag goes back to its start."""
        ticket.live = False
        self._live -= 1
        n = self._groups[ticket.group] - 1
        if n:
            self._groups[ticket.group] = n
        else:
            del self._groups[ticket.group]
        state = self._tenants[ticket.tenant]
        state.live -= 1
        if not state.live:
            del self._tenants[ticket.tenant]  # no waiter: no state (no credit, no debt)
            return
        queue = state.queue
        if rollback and queue[-1] is ticket:
            queue.pop()
            state.finish = ticket.tag
        while queue and not queue[0].live:
            queue.popleft()
        if len(queue) > 2 * state.live:  # dead tickets in the middle: keep memory bounded
            state.queue = deque(t for t in queue if t.live)

    def statistics(self) -> FairQueueStatistics:
        return FairQueueStatistics(
            waiting=self._live,
            tenants=len(self._tenants),
            pushed=self._pushed,
            granted=self._granted,
            cancelled=self._cancelled,
            refused=self._refused,
            pushed_out=self._pushed_out,
        )


def prioritized(body: bytes, priority: int) -> bytes | None:
    """A batch request's JSON body with ``"priority": priority``, for an engine that schedules
    by priority (None: not a JSON object). Only batch requests pay for this decode and
    re-encode, and only JSON bodies of the generation kinds (``PRIORITY_KINDS``)."""
    doc = orjson.loads(body)
    if not isinstance(doc, dict):
        return None
    doc["priority"] = priority
    return orjson.dumps(doc)
