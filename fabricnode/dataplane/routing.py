"""The routing core: which node serves a request, in what failover order, or HOLD it for now.

One module of about 900 lines on purpose: the policies share the load score and the candidate
records and are read against the rules and the theory below (a hundred lines of this
docstring); the prefix policy is a third of the code and makes sense only beside them.

Rules
-----
1. Pure: no I/O, no clock reads, no trio. Every call that needs time takes ``now``, the *wall
   clock* (``LoadSnapshot.at`` is the reporting node's wall clock). The only state is a policy's
   own counters and affinity indexes, updated through ``on_routed`` and ``on_removed``.
2. A policy only ever returns the candidates it was given: ``rank`` is a permutation of its input
   (first = the pick, the rest = failover order) or ``None`` (HOLD, pending-aware policy only).
   Stale index entries (a removed node, an evicted session) can therefore cost a worse pick,
   never a wrong destination.
3. Load reports are unsigned and may be stale. A report is trusted while ``|now - at| <=
   load_stale_after_s`` (the bound in the future too: a report dated far ahead would otherwise
   stay "fresh" forever). Untrusted or missing reports leave only this ingress's own in-flight
   count, plus a small penalty for not knowing.
4. Filters come first, in the ingress: the allowlist is checked against the *cryptographic*
   provider identity (``provider_allowed``) and ``X-Fabric-Require`` against the node's signed
   facts (``meets``). Policies never see a filtered-out node.
5. Every index is bounded: the prefix index by ``prefix_max_entries`` block entries across all
   models, sticky sessions by ``session_max_entries``, both evicting least recently used.

Theory of operation
-------------------
``load_score`` folds a node's last report and our in-flight count into one number, lower is
better. Waiting requests dominate (SkyLB's observation: a non-empty queue means the continuous
batch is full, and it predicts time-to-first-token far better than the number of running
requests). Our own in-flight requests are *added* to the report, although the report already
counts the ones we had sent before it was taken. We only have counts, not timestamps, so we
cannot tell which of ours the report saw; the two sound choices are ``max(reported, local)``
(never over-counts, but hides every request we send until our count exceeds the node's whole
reported load, so between two reports the ingress herds onto whichever node looked idlest) and
``reported + local`` (over-counts by our share at report time). We take the sum: each request we
send raises the score at once, which is what spreads a burst between reports; and the over-count
is benign for ordering at both extremes (one ingress among many: our share is small; the only
ingress: every node's load is roughly doubled alike).

The score also adds ``prefill_weight`` per second of *prefill backlog* (``Candidate.prefill_s``,
from ``prefill.PrefillClocks``): the prompts this ingress sent the node that it estimates are
not prefilled yet. A new prompt waits for them whatever the counts say, and counts cannot tell
thirty requests in cheap decode from two whose prompts are being computed. This is what keeps
interactive requests off the nodes where batch prompts are being prefilled (``bench/tiers.py``).

An interactive request does not wait for batch-tier requests on a node whose engine schedules by
priority: it goes ahead of them in the engine's queue and shares each step with their decoding,
which costs a new prompt little (the prompt computed in the step in progress is on the prefill
clock). So when the ingress routes one it marks this ingress's batch requests on such nodes as
*hidden* (``Candidate.hidden``), and the score leaves them out of our in-flight count and of the
report's counts. Without this, a node decoding thirty batch requests scored like thirty
requests' worth of queue (0.3 s of prefill by the weights), and interactive prompts went to the
other node while it was still computing a long prompt (engine step logs of ``bench/tiers.py``:
over half of the interactive requests that queued in the slowest 15%).

``prompt_blocks`` turns a prompt into cumulative hashes of whole fixed-size character blocks, so
two prompts share their first k values exactly when they share their first k blocks. The prefix
policy keeps an approximate, LRU-bounded map from (model, block hash) to the few nodes that last
received a request with that prefix: a flattened version of SkyLB's prefix trie (§3.2) in which
a trie node is the cumulative hash of its path. Insertion goes from the deepest block to the
shallowest, so shallow blocks are always the more recently used and LRU evicts from the leaves:
the index stays (approximately) prefix-closed and the longest match can be found by binary
search, O(log blocks) lookups per request.

The prefix policy, in order: (a) sticky session: the node the session key last went to, if it is
a candidate and not overloaded; (b) the longest prefix match among candidates that are not
overloaded, if it is strong (at least ``prefix_min_match_blocks`` blocks and
``prefix_min_match_ratio`` of the prompt's blocks); (c) otherwise least load. "Overloaded" is the
load guard: a score above both ``min + overload_abs_margin`` and ``min * overload_ratio``, where
``min`` is the best score among the candidates. Among nodes holding the same matched prefix the
least loaded wins, so a popular system prompt spreads over every node that has it cached.

The pending-aware policy (SkyLB's selective pushing, SP-P, §3.3) is the prefix policy with one
change in step (c): when no node has affinity, the least loaded is chosen among *open* nodes only,
and the request is HELD (``rank`` returns ``None``) when no node is open. Affinity comes first,
even to a backlogged node, as long as it passes the load guard: measured on ``bench/routing.py``
(docs/benchmarks-history.md), holding or diverting a request whose prefix is cached on a node with
a short queue costs more (a full prefill elsewhere, and the cache entry on the other node then
splits the tree's later requests) than waiting in that node's queue. A node is *backlogged* (not
open) only on a fresh report, when it has more than ``pending_waiting_threshold`` waiting requests
(default 1: a queue of two or more means the batch is full), when it has any waiting request and
its KV cache is at least ``pending_kv_full`` used (default 0.9: that one is a queue, not an
arrival, since the engine has no room to admit it until a request ends), or when this ingress
already has ``max(pending_min_local_inflight, pending_local_per_running * running)`` requests in
flight to it (the report cannot see what we pushed since it was taken; the cap doubles per report
while the node keeps admitting, so it follows an unknown batch size without a fixed limit). A node
whose load is unknown or stale is always open, so a HOLD always resolves: a fresh report showing
room, one of our requests finishing, or the reports ageing out within ``load_stale_after_s``. The
ingress must still bound how long it holds one request: under overload sustained from elsewhere,
fresh reports may keep showing queues; it then asks again with ``allow_hold=False`` and pushes to
the policy's least-loaded pick.

Why a queue of one does not close a node: an engine counts a request as waiting from its arrival
until the next step admits it, so a snapshot often shows one waiting request on a node with room
(the request that came during the step in progress). A report is taken every half second and
stands until the next one, so with a threshold of 0 such a snapshot on every node held requests
at the ingress for up to half a second while the engines had room. Measured on ``bench/tiers.py``
(docs/benchmarks-history.md, "Priority tiers", with ``bench/tiers_model.py``): with a batch beside
the interactive requests, such snapshots on both nodes were common, held requests were about a
third of the slowest 5%, and the batch tier's cost to the interactive p95 fell from ~1.1x to ~1.02x
with the threshold at 1. But on a node whose KV cache is full (long prompts: the Azure
conversation trace's 1,155 tokens on an L4), one waiting request is the head of a queue, and the
threshold let requests in behind it: measured on ``bench/federation.py`` (docs/benchmarks.md),
closing such a node too took two-layer routing from 93.6% to 96.2% of requests within a 2 s TTFT
objective (site-local from 55.5% to 57.2%), with ``bench/routing_model.py``'s shared-prompts
(21.1 against 20.6 req/s, p90 0.39 against 0.44 s, 4 seeds) and ``bench/tiers_model.py``'s tiered
cell (p95 1.026x against 1.022x alone) unchanged within their spread.
"""

from __future__ import annotations

import functools
import math
import random
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

# What the policies know of a request: the base of the decoder's routed record.
from fabricnode.dataplane.request import Requirements
from fabricnode.dataplane.request import RouteRequest as RouteRequest
from fabricnode.mesh.sites import DEFAULT_SITE

# -- node facts and requests --------------------------------------------------------------------


PROMPT_BLOCK_CHARS = 64  # ``prompt_blocks``' block, in characters
# The ingress estimates a prompt's tokens as its body's bytes / 4 (``request``): a block's
# tokens in the same units, for its prefill time (``sites.Prompt``).
BLOCK_TOKENS_EST = PROMPT_BLOCK_CHARS / 4


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """Static facts from a node's signed registry entry, for one model."""

    session_id: str
    url: str  # the node agent's http URL, e.g. "http://10.0.0.5:8080"
    provider: str  # claimed provider name: free text, NOT trusted
    verified_provider: str | None  # fingerprint of the certifying provider key; None = unverified
    certified_name: str | None  # provider name inside a valid certificate (None if not certified)
    gpu_type: str  # catalogue name, e.g. "H100", "A100-80G"; "" unknown
    gpu_count: int
    max_model_len: int | None  # context length for this model, None unknown
    quantization: str | None  # None (16-bit), "fp8", "awq", "gptq", "int8", "bitsandbytes", ...
    site: str = DEFAULT_SITE  # the site the owner signed (mesh.sites)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The last gossiped load report of a node: unsigned, and possibly stale."""

    waiting: int
    running: int
    kv_usage: float  # 0..1
    inflight: int  # requests the node's own agent has in flight to its engine
    at: float  # the reporting node's wall-clock time of the report


# Candidate and RouteRequest are made once per request (Candidate once per eligible node): plain
# classes, not dataclasses, because the compiled data plane (fabricnode/native.py) runs a plain
# class's __init__ natively while a dataclass's generated __init__ stays interpreted.


class Candidate:
    """One eligible node for one request, with what the policies score it by."""

    __slots__ = ("hidden", "load", "local_inflight", "node", "prefill_s")

    def __init__(
        self,
        node: NodeInfo,
        load: LoadSnapshot | None,
        local_inflight: int,
        prefill_s: float = 0.0,
    ) -> None:
        self.node = node
        self.load = load
        self.local_inflight = local_inflight  # requests THIS ingress has in flight to the node
        # Seconds of prefill THIS ingress sent the node that are still ahead (``prefill``).
        self.prefill_s = prefill_s
        # How many of those requests the one being routed does not wait for: this ingress's
        # batch-tier requests on a node that schedules by priority, when routing an interactive
        # one (set by the ingress; ``load_score`` takes them out of every count).
        self.hidden = 0

    def __repr__(self) -> str:
        return (
            f"Candidate({self.node.session_id!r}, {self.load!r}, {self.local_inflight}, "
            f"{self.prefill_s:.3f}, hidden={self.hidden})"
        )


# -- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Every routing tunable. Score weights are in "running requests": 1.0 = one running request.

    Defaults are starting points chosen from the papers' rules of thumb; the policy and its
    thresholds are to be settled by measurement.
    """

    # Load reports older (or further in the future) than this are not trusted.
    load_stale_after_s: float = 3.0
    # A waiting request predicts TTFT far better than a running one (SkyLB §3.3): weigh it more.
    waiting_weight: float = 4.0
    running_weight: float = 1.0
    # A full KV cache means the engine is about to queue or preempt even with few requests.
    kv_weight: float = 4.0
    # Each request this ingress has in flight to the node (see the module docstring).
    local_inflight_weight: float = 1.0
    # Added when the report is missing or stale: prefer a node we know to be idle, a little.
    unknown_load_penalty: float = 1.0
    # Per second of prefill this ingress sent the node that is still ahead (``prefill``): a new
    # prompt waits for it whatever the counts say. 100: a tenth of a second (one ~1,000-token
    # prompt of an 8B model on an A100) weighs as ten running requests, so an idle node wins
    # over one in the middle of a prefill unless that one is far emptier (bench/tiers.py).
    prefill_weight: float = 100.0
    # Prompt hashing, passed by the ingress to ``prompt_blocks``. 64 chars ~ 16 tokens, one
    # vLLM KV block; 256 blocks cover the first 16 KiB of a prompt, plenty to tell prefixes apart.
    prefix_block_chars: int = PROMPT_BLOCK_CHARS
    prefix_max_blocks: int = 256
    # Hard cap on prefix index entries (one per distinct block hash, all models): ~20 MB.
    prefix_max_entries: int = 100_000
    # Nodes remembered per block (most recent first): a shared system prompt lives on several.
    prefix_nodes_per_block: int = 4
    # A match is "strong" with at least this many blocks AND this fraction of the prompt's
    # blocks (SkyLB explores other replicas below ~50 % prefix hit ratio).
    prefix_min_match_blocks: int = 4
    prefix_min_match_ratio: float = 0.5
    # Load guard: a node is overloaded when its score exceeds BOTH min + abs and min * ratio,
    # min being the best candidate's score (abs keeps light loads from thrashing, ratio scales).
    overload_abs_margin: float = 8.0
    overload_ratio: float = 1.5
    # Sticky sessions remembered (LRU).
    session_max_entries: int = 65_536
    # Pending-aware policy: backlogged = fresh report with waiting > this (1: a queue of one is
    # usually the arrival the step in progress will admit; module docstring) ...
    pending_waiting_threshold: int = 1
    # ... or any waiting request while its KV cache is at least this full (module docstring) ...
    pending_kv_full: float = 0.9
    # ... or our in-flight >= max(pending_min_local_inflight, pending_local_per_running * running).
    pending_min_local_inflight: int = 8
    pending_local_per_running: float = 2.0

    def __post_init__(self) -> None:
        positive = {
            "load_stale_after_s": self.load_stale_after_s,
            "prefix_block_chars": self.prefix_block_chars,
            "prefix_max_entries": self.prefix_max_entries,
            "prefix_nodes_per_block": self.prefix_nodes_per_block,
            "session_max_entries": self.session_max_entries,
            "overload_ratio": self.overload_ratio,
            "pending_min_local_inflight": self.pending_min_local_inflight,
        }
        non_negative = {
            "waiting_weight": self.waiting_weight,
            "running_weight": self.running_weight,
            "kv_weight": self.kv_weight,
            "local_inflight_weight": self.local_inflight_weight,
            "unknown_load_penalty": self.unknown_load_penalty,
            "prefill_weight": self.prefill_weight,
            "prefix_max_blocks": self.prefix_max_blocks,
            "prefix_min_match_blocks": self.prefix_min_match_blocks,
            "prefix_min_match_ratio": self.prefix_min_match_ratio,
            "overload_abs_margin": self.overload_abs_margin,
            "pending_waiting_threshold": self.pending_waiting_threshold,
            "pending_kv_full": self.pending_kv_full,
            "pending_local_per_running": self.pending_local_per_running,
        }
        for key, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"routing config {key}={value!r}: must be > 0")
        for key, value in non_negative.items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"routing config {key}={value!r}: must be >= 0")
        if self.prefix_min_match_ratio > 1:
            raise ValueError("routing config prefix_min_match_ratio: must be <= 1")


DEFAULT_CONFIG = RoutingConfig()


# -- load ---------------------------------------------------------------------------------------


def _fresh(load: LoadSnapshot, now: float, cfg: RoutingConfig) -> bool:
    # Written so that NaN times fail too.
    return abs(now - load.at) <= cfg.load_stale_after_s


def load_score(c: Candidate, now: float, cfg: RoutingConfig) -> float:
    """Lower is better. See the module docstring for why our in-flight count is added.

    The report's ``inflight`` (the node agent's requests to its engine) overlaps
    ``waiting + running``; only its excess, requests the engine has not counted yet, is added.
    Report fields are clamped: they are unsigned and must not produce NaN or negative scores.
    ``c.hidden`` of our requests, which the request being routed will not wait for, leave our
    count and the report's (``_visible``).
    """
    load = c.load
    hidden = c.hidden
    local = cfg.local_inflight_weight * max(0, c.local_inflight - hidden)
    prefill_s = c.prefill_s
    if prefill_s > 0.0:
        local += cfg.prefill_weight * prefill_s
    if load is None or not _fresh(load, now, cfg):
        return local + cfg.unknown_load_penalty
    waiting, running, in_transit = _visible(load, hidden)
    kv = load.kv_usage
    kv = (1.0 if kv > 1.0 else kv) if kv >= 0.0 else 0.0  # NaN -> 0.0
    return (
        cfg.waiting_weight * waiting
        + cfg.running_weight * (running + in_transit)
        + cfg.kv_weight * kv
        + local
    )


def _visible(load: LoadSnapshot, hidden: int) -> tuple[int, int, int]:
    """The report's waiting, running and in-transit counts (clamped at 0) without ``hidden``
    requests of ours. The report cannot say where ours are, so they come out of running first
    (where batch work mostly is), then waiting, then in transit; a report older than some of
    them just reaches 0 sooner."""
    waiting = max(0, load.waiting)
    running = max(0, load.running)
    in_transit = max(0, load.inflight - waiting - running)
    if hidden > 0:
        out = min(hidden, running)
        running -= out
        hidden -= out
        out = min(hidden, waiting)
        waiting -= out
        in_transit = max(0, in_transit - (hidden - out))
    return waiting, running, in_transit


def _without_prefill(
    candidates: Sequence[Candidate], scores: list[float], cfg: RoutingConfig
) -> list[float]:
    """The scores without their prefill backlog, for the affinity guard: a node's backlog is
    what this ingress sent it, and a request with affinity there shares those prompts' prefix,
    which its engine has cached, so that backlog overstates what it waits for. (The clock
    counts whole prompts: the ingress cannot tell which tokens the engine has cached.)"""
    weight = cfg.prefill_weight
    if not weight or not any(c.prefill_s > 0.0 for c in candidates):
        return scores
    return [s - weight * c.prefill_s for c, s in zip(candidates, scores, strict=True)]


def _backlogged(c: Candidate, now: float, cfg: RoutingConfig) -> bool:
    """SP-P's "full" test; never true without a fresh report, so every HOLD resolves."""
    load = c.load
    if load is None or not _fresh(load, now, cfg):
        return False
    waiting, running, _ = _visible(load, c.hidden)
    if waiting > cfg.pending_waiting_threshold:
        return True
    if waiting > 0 and load.kv_usage >= cfg.pending_kv_full:
        return True  # a queue, not an arrival: no room for it until a request ends
    cap = max(cfg.pending_min_local_inflight, cfg.pending_local_per_running * running)
    return c.local_inflight - c.hidden >= cap


# -- prompt hashing -----------------------------------------------------------------------------


def prompt_blocks(
    text: str, *, block_chars: int = PROMPT_BLOCK_CHARS, max_blocks: int = 256
) -> tuple[int, ...]:
    """Cumulative hashes of the prompt's whole ``block_chars`` blocks, at most ``max_blocks``.

    Value i covers ``text[: (i + 1) * block_chars]``: it chains the previous value with block i,
    so prompts share the first k values iff they share the first k whole blocks (up to hash
    collisions, which only cost a worse pick). A trailing partial block is ignored: it would
    change with every extra character and can never be a cached prefix of another prompt. Uses
    ``hash()``, so values are stable within one process only, which is all the index needs.
    Cost is O(min(len(text), block_chars * max_blocks)), about 40 us for 256 blocks.
    """
    if block_chars < 1 or max_blocks < 0:
        raise ValueError("prompt_blocks: block_chars must be >= 1 and max_blocks >= 0")
    end = min(len(text) // block_chars, max_blocks) * block_chars
    out: list[int] = []
    append = out.append
    h = 0
    for i in range(0, end, block_chars):
        h = hash((h, text[i : i + block_chars]))
        append(h)
    return tuple(out)


# -- policies -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoutingStatistics:
    """Counters of one policy, for /metrics and tests. Prefix fields stay 0 for other policies.

    Every ranked request that is not held counts in exactly one of ``sticky_hits``,
    ``prefix_hits``, ``misses`` (no prefix match at all), ``fallbacks_weak`` (a match below the
    strength threshold) or ``fallbacks_overloaded`` (only overloaded nodes had a strong match);
    for the non-prefix policies only ``ranked`` moves. ``holds`` counts ``rank`` calls that
    returned None, so a request held through several re-asks counts once per re-ask.
    """

    policy: str
    ranked: int = 0
    holds: int = 0
    sticky_hits: int = 0
    prefix_hits: int = 0
    misses: int = 0
    fallbacks_weak: int = 0
    fallbacks_overloaded: int = 0
    index_entries: int = 0
    index_capacity: int = 0
    sessions: int = 0
    nodes: int = 0


class Policy(Protocol):
    name: str

    def rank(
        self,
        req: RouteRequest,
        candidates: Sequence[Candidate],
        now: float,
        *,
        allow_hold: bool = True,
    ) -> list[Candidate] | None:
        """Candidates in the order to try them (first = the pick; the rest = failover order,
        every candidate exactly once). None = HOLD: keep the request queued at the ingress and
        ask again later (only the pending-aware policy returns None, and never with
        ``allow_hold=False``: the ingress passes that once a request has been held long
        enough, to get the policy's own best push). Never called with an empty sequence."""
        ...

    def on_routed(self, req: RouteRequest, session_id: str, now: float) -> None:
        """The request was sent to session_id (update affinity indexes)."""
        ...

    def on_removed(self, session_id: str) -> None:
        """The node is gone (LEFT/DOWN/dead): drop it from any index."""
        ...

    def held_blocks(self, req: RouteRequest, session_id: str) -> int:
        """How many leading blocks of ``req``'s prompt (``prompt_blocks``) this ingress last
        sent to ``session_id`` (a node, or a peer site's gateway: the cross-site cost,
        ``sites`` rule 6), by its prefix index; 0 for a policy that keeps none."""
        ...

    def statistics(self) -> RoutingStatistics: ...


_TIE = 1e-9  # scores closer than this are equal (sums of small floats)


def _by_score(candidates: Sequence[Candidate], scores: list[float], pick: int) -> list[Candidate]:
    """``pick`` first, then the others by ascending score (stable: input order breaks ties)."""
    order = sorted(range(len(scores)), key=scores.__getitem__)
    out = [candidates[pick]]
    out.extend(candidates[i] for i in order if i != pick)
    return out


def _least(scores: list[float], pool: Sequence[int], turn: int) -> int:
    """Index of a least score within ``pool``; ``turn`` rotates among equal ones, so equal
    nodes share the load instead of the first one getting everything."""
    best = min(scores[i] for i in pool)
    ties = [i for i in pool if scores[i] <= best + _TIE]
    return ties[turn % len(ties)]


class _StatelessPolicy:
    """Base of the policies that keep no index of nodes or requests (a turn counter at most):
    ``on_routed`` and ``on_removed`` have nothing to update, and only ``ranked`` counts."""

    __slots__ = ("_ranked", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._ranked = 0

    def on_routed(self, req: RouteRequest, session_id: str, now: float) -> None:
        pass

    def on_removed(self, session_id: str) -> None:
        pass

    def held_blocks(self, req: RouteRequest, session_id: str) -> int:
        return 0

    def statistics(self) -> RoutingStatistics:
        return RoutingStatistics(self.name, ranked=self._ranked)


class RoundRobinPolicy(_StatelessPolicy):
    """Rotating start index; the rest in rotation order. Load-blind: a baseline."""

    __slots__ = ("_turn",)

    def __init__(self) -> None:
        super().__init__("round-robin")
        self._turn = 0

    def rank(
        self,
        req: RouteRequest,
        candidates: Sequence[Candidate],
        now: float,
        *,
        allow_hold: bool = True,
    ) -> list[Candidate] | None:
        start = self._turn % len(candidates)
        self._turn += 1
        self._ranked += 1
        out = list(candidates[start:])
        out.extend(candidates[:start])
        return out


class LeastLoadPolicy(_StatelessPolicy):
    """Least ``load_score``; equal scores take turns."""

    __slots__ = ("_cfg", "_turn")

    def __init__(self, cfg: RoutingConfig) -> None:
        super().__init__("least-load")
        self._cfg = cfg
        self._turn = 0

    def rank(
        self,
        req: RouteRequest,
        candidates: Sequence[Candidate],
        now: float,
        *,
        allow_hold: bool = True,
    ) -> list[Candidate] | None:
        cfg = self._cfg
        scores = [load_score(c, now, cfg) for c in candidates]
        pick = _least(scores, range(len(scores)), self._turn)
        self._turn += 1
        self._ranked += 1
        return _by_score(candidates, scores, pick)


class PowerOfTwoPolicy(_StatelessPolicy):
    """Two random candidates, the less loaded wins; the rest by score.

    Randomness makes many ingresses with the same stale view pick different nodes, where
    least-load would have them all pick the same one.
    """

    __slots__ = ("_cfg", "_rng")

    def __init__(self, cfg: RoutingConfig, rng: random.Random) -> None:
        super().__init__("p2c")
        self._cfg = cfg
        self._rng = rng

    def rank(
        self,
        req: RouteRequest,
        candidates: Sequence[Candidate],
        now: float,
        *,
        allow_hold: bool = True,
    ) -> list[Candidate] | None:
        cfg = self._cfg
        self._ranked += 1
        n = len(candidates)
        scores = [load_score(c, now, cfg) for c in candidates]
        if n == 1:
            return [candidates[0]]
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        if j >= i:
            j += 1
        pick = i if scores[i] <= scores[j] else j
        return _by_score(candidates, scores, pick)


class PrefixPolicy:
    """Sticky session, else longest strong prefix match under the load guard, else least load;
    with ``pending_aware`` also SkyLB's selective pushing (see the module docstring).

    Nodes are interned as small integer *slots*, never reused. ``on_removed`` forgets a node's
    slot in O(1): index and session entries still naming it then resolve to nothing and age out
    through LRU eviction, and a node that comes back gets a fresh slot, so it inherits no stale
    affinity. This keeps removal off the hot path (no scan of 100k entries).
    """

    __slots__ = (
        "_cfg",
        "_hits",
        "_holds",
        "_index",
        "_misses",
        "_next_slot",
        "_overloaded",
        "_pending_aware",
        "_ranked",
        "_sessions",
        "_slot_of",
        "_sticky",
        "_turn",
        "_weak",
        "name",
    )

    def __init__(self, cfg: RoutingConfig, *, pending_aware: bool) -> None:
        self.name = "prefix-pending" if pending_aware else "prefix"
        self._cfg = cfg
        self._pending_aware = pending_aware
        # (block hash ^ hash(model)) -> slots, most recent first; LRU order, oldest first.
        self._index: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        # hash((model, session key)) -> slot; LRU. Hashed so long keys cost no memory.
        self._sessions: OrderedDict[int, int] = OrderedDict()
        self._slot_of: dict[str, int] = {}
        self._next_slot = 0
        self._turn = 0
        self._ranked = self._holds = self._sticky = self._hits = 0
        self._misses = self._weak = self._overloaded = 0

    def rank(
        self,
        req: RouteRequest,
        candidates: Sequence[Candidate],
        now: float,
        *,
        allow_hold: bool = True,
    ) -> list[Candidate] | None:
        cfg = self._cfg
        n = len(candidates)
        scores = [load_score(c, now, cfg) for c in candidates]
        everyone = range(n)
        pick = self._affinity(req, candidates, _without_prefill(candidates, scores, cfg))
        closed: list[bool] = []
        if pick < 0:
            pool: Sequence[int] = everyone
            if self._pending_aware:
                closed = [_backlogged(c, now, cfg) for c in candidates]
                pool = [i for i in everyone if not closed[i]]
                if not pool:
                    if allow_hold:
                        self._holds += 1
                        return None
                    pool = everyone
            pick = _least(scores, pool, self._turn)
            self._turn += 1
        self._ranked += 1
        if not closed or not any(closed):
            return _by_score(candidates, scores, pick)
        # Failover prefers open nodes too: pushing into a queue is what SP-P avoids.
        order = sorted(everyone, key=lambda i: (closed[i], scores[i]))
        out = [candidates[pick]]
        out.extend(candidates[i] for i in order if i != pick)
        return out

    def _affinity(
        self, req: RouteRequest, candidates: Sequence[Candidate], scores: list[float]
    ) -> int:
        """The sticky or strong-prefix node under the load guard, else -1 (counted as a miss,
        a weak match or an overloaded match)."""
        cfg = self._cfg
        best = min(scores)
        limit = max(best + cfg.overload_abs_margin, best * cfg.overload_ratio)
        slot_of = self._slot_of
        known: dict[int, int] = {}  # slot -> candidate index, every candidate with a slot
        for i, c in enumerate(candidates):
            slot = slot_of.get(c.node.session_id)
            if slot is not None:
                known[slot] = i

        if known and req.session_key is not None:
            slot = self._sessions.get(hash((req.model, req.session_key)))
            if slot is not None:
                i = known.get(slot, -1)
                if i >= 0 and scores[i] <= limit:
                    self._sticky += 1
                    return i

        blocks = req.prefix_blocks[: cfg.prefix_max_blocks]
        total = len(blocks)
        matched = 0
        if known and total:
            salt = hash(req.model)
            matched = self._longest(blocks, total, salt, known, scores, math.inf)
            if matched:
                # Usually the deepest match is on an eligible node: one probe, not a search.
                eligible = self._longest(blocks, matched, salt, known, scores, limit)
                strong = max(cfg.prefix_min_match_blocks, cfg.prefix_min_match_ratio * total)
                if eligible and eligible >= strong:
                    self._hits += 1
                    return self._best_at(blocks[eligible - 1] ^ salt, known, scores, limit)
                if matched >= strong:
                    self._overloaded += 1
                else:
                    self._weak += 1
        if not matched:
            self._misses += 1
        return -1

    def _longest(
        self,
        blocks: tuple[int, ...],
        hi: int,
        salt: int,
        known: dict[int, int],
        scores: list[float],
        limit: float,
    ) -> int:
        """How many leading blocks (at most ``hi``) some known candidate scoring <= ``limit``
        holds.

        Binary search, relying on the index being (approximately) prefix-closed; when it is not,
        the answer is a shorter match than the best, never a wrong one. The first probe is at
        ``hi``, so a full match (a resent prompt; the eligibility re-check) costs one lookup.
        """
        index = self._index
        lo = 0
        first = True
        while lo < hi:
            if first:
                mid, first = hi, False
            else:
                mid = (lo + hi + 1) // 2
            slots = index.get(blocks[mid - 1] ^ salt)
            ok = False
            if slots is not None:
                for slot in slots:
                    i = known.get(slot, -1)
                    if i >= 0 and scores[i] <= limit:
                        ok = True
                        break
            if ok:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _best_at(self, key: int, known: dict[int, int], scores: list[float], limit: float) -> int:
        """The least loaded eligible candidate holding the block ``key`` (``_longest`` found
        at least one)."""
        best = -1
        for slot in self._index[key]:
            i = known.get(slot, -1)
            if i >= 0 and scores[i] <= limit and (best < 0 or scores[i] < scores[best]):
                best = i
        return best

    def on_routed(self, req: RouteRequest, session_id: str, now: float) -> None:
        cfg = self._cfg
        slot = self._slot_of.get(session_id)
        if slot is None:
            slot = self._next_slot
            self._next_slot += 1
            self._slot_of[session_id] = slot
        if req.session_key is not None:
            sessions = self._sessions
            key = hash((req.model, req.session_key))
            sessions[key] = slot
            sessions.move_to_end(key)
            if len(sessions) > cfg.session_max_entries:
                sessions.popitem(last=False)
        index = self._index
        cap = cfg.prefix_max_entries
        keep = cfg.prefix_nodes_per_block
        salt = hash(req.model)
        blocks = req.prefix_blocks[: cfg.prefix_max_blocks]
        get, touch = index.get, index.move_to_end
        # Deepest first, so the shallow blocks end up most recently used (see module docstring).
        for h in reversed(blocks):
            key = h ^ salt
            slots = get(key)
            if slots is None:
                index[key] = (slot,)
                if len(index) > cap:
                    index.popitem(last=False)
                continue
            if slots[0] != slot:
                index[key] = (slot, *[s for s in slots if s != slot][: keep - 1])
            touch(key)

    def on_removed(self, session_id: str) -> None:
        self._slot_of.pop(session_id, None)

    def held_blocks(self, req: RouteRequest, session_id: str) -> int:
        slot = self._slot_of.get(session_id)
        blocks = req.prefix_blocks[: self._cfg.prefix_max_blocks]
        if slot is None or not blocks:
            return 0
        return self._longest(blocks, len(blocks), hash(req.model), {slot: 0}, [0.0], math.inf)

    def statistics(self) -> RoutingStatistics:
        return RoutingStatistics(
            self.name,
            ranked=self._ranked,
            holds=self._holds,
            sticky_hits=self._sticky,
            prefix_hits=self._hits,
            misses=self._misses,
            fallbacks_weak=self._weak,
            fallbacks_overloaded=self._overloaded,
            index_entries=len(self._index),
            index_capacity=self._cfg.prefix_max_entries,
            sessions=len(self._sessions),
            nodes=len(self._slot_of),
        )


_FACTORIES: dict[str, Callable[[random.Random, RoutingConfig], Policy]] = {
    "round-robin": lambda rng, cfg: RoundRobinPolicy(),
    "least-load": lambda rng, cfg: LeastLoadPolicy(cfg),
    "p2c": lambda rng, cfg: PowerOfTwoPolicy(cfg, rng),
    "prefix": lambda rng, cfg: PrefixPolicy(cfg, pending_aware=False),
    "prefix-pending": lambda rng, cfg: PrefixPolicy(cfg, pending_aware=True),
}
POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)
DEFAULT_POLICY = "prefix-pending"


def make_policy(
    name: str, *, rng: random.Random | None = None, config: RoutingConfig | None = None
) -> Policy:
    """A fresh policy; ``rng`` feeds the randomised ones (seed it in tests)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r} (one of: {', '.join(POLICY_NAMES)})")
    return factory(rng if rng is not None else random.Random(), config or DEFAULT_CONFIG)


# -- filters ------------------------------------------------------------------------------------


# Weight bits of the quantization methods vLLM and SGLang name (lower-cased). Methods whose
# width is configurable (bitsandbytes, gguf) get the lowest common width: a requirement is a
# quality floor, so it is only met by what is certainly at least that precise.
_QUANT_BITS: dict[str, int] = {
    **dict.fromkeys(("", "none", "auto", "fp16", "float16", "bf16", "bfloat16", "half"), 16),
    **dict.fromkeys(("fp32", "float32", "float"), 32),
    **dict.fromkeys(
        (
            "fp8",
            "int8",
            "w8a8",
            "w8a16",
            "fbgemm_fp8",
            "ptpc_fp8",
            "experts_int8",
            "modelopt",
            "tpu_int8",
            "fp8_e4m3",
            "fp8_e5m2",
            "smoothquant",
        ),
        8,
    ),
    **dict.fromkeys(("fp6", "fp6_llm"), 6),
    **dict.fromkeys(
        (
            "awq",
            "awq_marlin",
            "gptq",
            "gptq_marlin",
            "gptq_marlin_24",
            "gptq_bitblas",
            "marlin",
            "bitblas",
            "int4",
            "w4a16",
            "w4a8",
            "qqq",
            "bitsandbytes",
            "bnb",
            "gguf",
            "squeezellm",
            "hqq",
            "nvfp4",
            "mxfp4",
            "modelopt_fp4",
            "fp4",
            "nf4",
        ),
        4,
    ),
    **dict.fromkeys(("aqlm", "quip", "quip#"), 2),
}
_QUANT_PATTERN = re.compile(r"(?:w|int|uint|fp|nf|mxfp|nvfp)(\d{1,2})(?:a\d{1,2})?(?:[_-].*)?")


@functools.lru_cache(maxsize=256)
def quant_bits(quantization: str | None) -> int:
    """Weight bits of a quantization method: None -> 16 (unquantized), fp8/int8/w8a8 -> 8,
    awq/gptq/int4/bitsandbytes/gguf -> 4, ...; names like ``w4a16`` or ``int8_xyz`` by their
    digits. An unknown name -> 0, so it never meets a ``quant>=`` requirement (fail closed:
    the string is free text from the node, and the requirement is a quality floor)."""
    if quantization is None:
        return 16
    name = quantization.strip().lower()
    bits = _QUANT_BITS.get(name)
    if bits is not None:
        return bits
    m = _QUANT_PATTERN.fullmatch(name)
    if m is not None and 1 <= int(m.group(1)) <= 32:
        return int(m.group(1))
    return 0


def meets(node: NodeInfo, req: Requirements) -> bool:
    """Whether the node's signed facts satisfy every constraint; unknown facts fail."""
    if req.gpu is not None and node.gpu_type.lower() not in req.gpu:
        return False
    if req.min_quant_bits is not None and quant_bits(node.quantization) < req.min_quant_bits:
        return False
    if req.sites is not None and node.site not in req.sites:
        return False
    return req.min_context is None or (
        node.max_model_len is not None and node.max_model_len >= req.min_context
    )


def provider_allowed(
    node: NodeInfo,
    allowed: frozenset[str],
    pinned: Mapping[str, frozenset[str]] | None = None,
) -> bool:
    """Whether the node's *certified* provider is on the allowlist (empty = everyone).

    An item matches the fingerprint of the provider key that certified the session, or the
    provider name inside that certificate; a name that ``pinned`` (the operator's trusted
    providers) maps to fingerprints also needs the fingerprint to be one of them, since anyone
    can mint a provider key that certifies any name. A merely claimed provider never matches.
    """
    if not allowed:
        return True
    fingerprint = node.verified_provider
    if fingerprint is None:
        return False
    if fingerprint in allowed:
        return True
    name = node.certified_name
    if name is None or name not in allowed:
        return False
    keys = pinned.get(name) if pinned is not None else None
    return keys is None or fingerprint in keys
