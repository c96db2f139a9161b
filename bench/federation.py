"""SkyLB's experiment on the fabric (issue 41) as a model: three sites whose demands peak at
different times, the same replicas for every policy, and four ways to route them, side by side.

The policies:

* ``local``: site-local; each site's ingress routes to its own replicas only (today's policy,
  which holds a request while none of them can admit it). No request crosses the WAN.
* ``central``: one ingress, at site A, routes every site's clients over every replica with the
  same policy (GORGO's and the single-region balancers' shape: every request crosses to A
  and, unless served at A, back out).
* ``round-robin``: each site's ingress sends its requests to every replica in turn, wherever
  it is (blind pushing across sites).
* ``ours``: two-layer routing. Each site's ingress serves inside its site while a replica
  there can admit the request; when none can, its gateway pushes it to the peer site the
  product's own ``Across.push_routes`` picks from the site summaries it has (``sites.choose``:
  sites that can admit, by the GORGO-style expected time to first token), and the peer's
  gateway routes it inside its site with the same policy, never on again.
* ``ours-noprefix`` (with ``--tenants``): ``ours`` without pricing prompts' prefixes across
  sites (``sites`` rule 7), to measure what that pricing is worth.

What is real: the routing policy with its load scores and prefill clocks (``routing``,
``prefill``), the push decision and the site chooser (``dataplane.across``, ``dataplane.sites``)
fed with ``SiteOffer``s counted the way ``federation.summary.capacity_of`` counts them, the
summaries' cadence and freshness rule (``federation.view.fresh``: every ``summary_period_s``,
fresh while no older than a period, the round trip and ``FRESH_SLACK_S``), the simulated engine's
scheduler (``simengine.model.Scheduler``: continuous batching, KV blocks, preemption, roofline
step times of an 8B model on an L4, as SkyLB's replicas), and the trace: the Azure LLM
conversation trace in ../shared/data, its arrival times and prompt and output lengths.

What is modelled: the network (one-way latency half the round trip between sites, 1 ms inside
a site; the WAN's bandwidth is not a limit), load reports every ``--report-s`` reaching an
ingress of the same site 5 ms later and being counted into the site's summary, a held request
asked again when a request of its ingress ends or 50 ms later and sent past ``hold_max_s``.

The demand: each site replays the trace compressed into one ``--day`` (the hour becomes the
day), starting a third of it later than the previous site (other requests), and keeps each
request with the probability of a day-shaped envelope, ``--scale`` times
``(1 + a cos(2 pi (t/day - (k + 1/2)/3))) / (1 + a)``: site k (A, B, C) peaks at (k + 1/2)/3 of
the day, and the three envelopes sum to a constant, so the global peak is the mean (SkyLB's
Figure 3, taken to its ideal). Sites A, B, C; round trips A-B 40 ms, A-C 150 ms, B-C 250 ms.

Reported per policy: requests answered within the TTFT objective (share and per second), TTFT
p50/p90 and end-to-end p50/p90 over the day and while site A is at its peak (the sixth of the
day around it), WAN bytes (request bodies and SSE answers that cross sites), and, with
``--search``, the fewest replicas (spread over the sites as evenly as they go; site-local: per
site) that hold the objective for ``--attain`` of the requests. ``--cut`` adds the day in which
site A is cut off from B and C for a tenth of it: the central ingress then serves nothing of B's
and C's clients.

    python bench/federation.py                       # the four policies at 4 replicas a site
    python bench/federation.py --search              # + the replicas each needs (~5 min)
    python bench/federation.py --quick               # a smoke run (tests/system)
    python bench/federation.py --tenants 4 --system-tokens 1000 --scale 0.11
                                                     # shared system prompts, + ours-noprefix
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for _path in (str(REPO), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _model_core import EngineNode, ModelCore  # noqa: E402
from routing_model import parse_config  # noqa: E402
from tiers import ATTRIBUTION, TRACE, Request, load_trace  # noqa: E402

from fabricnode.dataplane import routing  # noqa: E402
from fabricnode.dataplane.across import Across  # noqa: E402
from fabricnode.dataplane.ingress_config import IngressConfig  # noqa: E402
from fabricnode.dataplane.prefill import PrefillClocks  # noqa: E402
from fabricnode.dataplane.request import RouteRequest  # noqa: E402
from fabricnode.dataplane.routetable import Route  # noqa: E402
from fabricnode.dataplane.sites import Prompt, SiteOffer  # noqa: E402
from fabricnode.federation.settings import FederationConfig  # noqa: E402
from fabricnode.federation.view import FRESH_SLACK_S  # noqa: E402
from fabricnode.mesh.keyring import Keyring  # noqa: E402
from fabricnode.simengine.model import EngineConfig, Scheduler, TokenEvent, gpu_profile  # noqa: E402

MODEL = "sim-8b"
SITES = ("A", "B", "C")
RTT_S = {("A", "B"): 0.040, ("A", "C"): 0.150, ("B", "C"): 0.250}
LAN_S = 0.001  # one way, inside a site (client to ingress, ingress to replica)
HOLD_RETRY_S = 0.05  # Ingress._hold asks again at least this often
HOLD_MAX_S = IngressConfig().hold_max_s
SUMMARY_PERIOD_S = 1.0  # FederationConfig.summary_period_s
assert FederationConfig.__dataclass_fields__["summary_period_s"].default == SUMMARY_PERIOD_S
# Bytes on the WAN: a chat request's JSON body is ~4 bytes a prompt token plus its envelope
# (the ingress's own estimate, bytes / 4, read backwards); each streamed token is one SSE
# event of the OpenAI chunk shape, measured on the simulated engine's stream.
REQUEST_ENVELOPE_BYTES = 200
SSE_EVENT_BYTES = 190
POLICIES = ("local", "central", "round-robin", "ours")
# ``ours`` without pricing prompts' prefixes across sites (``sites`` rule 7): with --tenants
NO_PREFIX = "ours-noprefix"


def one_way(a: str, b: str) -> float:
    if a == b:
        return 0.0
    return RTT_S[(a, b) if (a, b) in RTT_S else (b, a)] / 2


@dataclass(frozen=True)
class Arrival:
    site: str  # the client's
    t: float
    prompt: int  # tokens, the tenant's system prompt included
    output: int
    tenant: int = -1  # its site's tenant whose system prompt it starts with (-1: none)


def demand(trace: list[Request], args: argparse.Namespace, seed: int) -> list[Arrival]:
    """Every site's requests over the day (module docstring), in time order."""
    rng = random.Random(seed)
    span = trace[-1].at_s + 1e-6
    squeeze = args.day / span
    limit = args.max_model_len
    out: list[Arrival] = []
    for k, site in enumerate(SITES):
        offset = span * k / len(SITES)
        for row in trace:
            t = ((row.at_s + offset) % span) * squeeze
            phase = 2 * math.pi * (t / args.day - (k + 0.5) / len(SITES))
            keep = args.scale * (1 + args.amplitude * math.cos(phase)) / (1 + args.amplitude)
            if rng.random() >= keep:
                continue
            output = min(row.output, limit // 4)
            tenant = rng.randrange(args.tenants) if args.tenants else -1
            system = args.system_tokens if tenant >= 0 else 0
            prompt = min(system + row.prompt, limit - output - 8)
            out.append(Arrival(site, t, prompt, output, tenant))
    out.sort(key=lambda a: a.t)
    return out


@dataclass(eq=False)
class Req:
    arrival: Arrival
    tokens: list[int]
    blocks: tuple[int, ...] = ()  # ``routing.prompt_blocks`` of its prompt (--tenants)
    ingress: Ingress | None = None  # the ingress holding or routing it now
    arrived_at: float = 0.0  # when it reached that ingress (its hold is bounded from there)
    pushed_to: str = ""  # the peer site ours pushed it to
    node_site: str = ""
    sid: str = ""
    rid: int = -1
    routed_at: float = 0.0
    due: float = 0.0
    sample: bool = False
    held: bool = False
    retrying: bool = False
    failed: bool = False
    ttft: float | None = None
    e2e: float | None = None
    # one-way seconds of the first token's way back from the replica's site to the client
    back_s: float = 0.0


class Node(EngineNode[Req]):
    site: str = ""


@dataclass
class Ingress:
    """One ingress: its policy, its prefill clocks, its requests in flight per node and the
    requests it holds; ``across`` on a gateway of the ``ours`` policy."""

    site: str
    policy: routing.Policy
    nodes: list[Node]
    clocks: PrefillClocks = field(default_factory=PrefillClocks)
    inflight: dict[str, int] = field(default_factory=dict)
    held: list[Req] = field(default_factory=list)
    across: Across | None = None
    turn: int = 0  # round robin's


class NoTable:
    """The route table ``Across`` reads on a gateway: no sleeping replicas, no other gateway."""

    def sleeping(self, model: str) -> list[Route] | None:
        return None

    def gateways(self) -> list[Route]:
        return []


@dataclass(frozen=True)
class Summary:
    """What a site's gateway says of the model, as ``capacity_of`` counts it."""

    replicas: int
    admitting: int
    waiting: int
    issued_at: float


@dataclass(frozen=True)
class Outcome:
    policy: str
    replicas: tuple[int, ...]
    requests: int
    within: float  # share answered within the objective
    good_per_s: float  # answered within the objective, per second of the day
    ttft_p50: float
    ttft_p90: float
    e2e_p50: float
    e2e_p90: float
    peak_within: float
    peak_good_per_s: float
    peak_ttft_p50: float
    peak_ttft_p90: float
    failed: int
    crossed: float  # share of requests served at another site than their client's
    wan_mb: float
    within_by_site: dict[str, float]
    cached: float = 0.0  # share of prompt tokens the engines' prefix caches held


class Model(ModelCore[Node, Req]):
    """One day of one policy."""

    def __init__(
        self,
        policy: str,
        replicas: tuple[int, ...],
        arrivals: list[Arrival],
        args: argparse.Namespace,
        seed: int,
        cut: tuple[float, float] | None = None,
    ) -> None:
        self.policy_name = policy
        self.args = args
        self.rng = random.Random(seed)
        self.cut = cut
        engine = EngineConfig(
            model=MODEL,
            gpu=gpu_profile(args.gpu),
            params_b=args.params_b,
            kv_tokens=args.kv_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
        )
        nodes: list[Node] = []
        for site, count in zip(SITES, replicas, strict=True):
            for i in range(count):
                sid = f"{site}{i}"
                info = routing.NodeInfo(
                    sid, f"http://{sid}", "p", None, None, args.gpu, 1, args.max_model_len, None,
                    site,
                )  # fmt: skip
                node = Node(sid, info, Scheduler(engine))
                node.site = site
                nodes.append(node)
        super().__init__(nodes, args.day + args.drain, args.report_s)
        self.replicas = replicas
        self.arrivals = arrivals
        cfg = parse_config(args.routing)
        by_site = {s: [n for n in nodes if n.site == s] for s in SITES}
        if policy == "central":
            central = Ingress("A", routing.make_policy(routing.DEFAULT_POLICY, config=cfg), nodes)
            self.ingresses = {s: central for s in SITES}
        elif policy == "round-robin":
            self.ingresses = {
                s: Ingress(s, routing.make_policy("round-robin", config=cfg), nodes) for s in SITES
            }
        else:
            self.ingresses = {
                s: Ingress(s, routing.make_policy(routing.DEFAULT_POLICY, config=cfg), by_site[s])
                for s in SITES
            }
        # What each site's gateway has heard of each peer: (summary, when it arrived).
        self.heard: dict[str, dict[str, tuple[Summary, float]]] = {s: {} for s in SITES}
        if policy in ("ours", NO_PREFIX):
            for s, ing in self.ingresses.items():
                ing.across = Across(s, NoTable(), Keyring, lambda _: None)
                ing.across.offers = self._offers_for(s)
        self.done: list[Req] = []
        self.pushes = 0
        self.token_seq = 0
        for a in arrivals:
            self.at(a.t, self.client_send, a)
        for n in self.nodes:
            self.at(self.rng.uniform(0, args.report_s), self.take_report, n)
        if policy in ("ours", NO_PREFIX):
            for s in SITES:
                self.at(self.rng.uniform(0, SUMMARY_PERIOD_S), self.summarise, s)

    # -- the network --

    def cut_off(self, a: str, b: str, now: float) -> bool:
        """Whether sites ``a`` and ``b`` cannot reach each other at ``now`` (``--cut``: A
        from the others)."""
        cut = self.cut
        return cut is not None and a != b and "A" in (a, b) and cut[0] <= now < cut[1]

    # -- the summaries (``ours``) --

    def summarise(self, now: float, site: str) -> None:
        nodes = [n for n in self.nodes if n.site == site]
        admitting = waiting = 0
        for n in nodes:
            report = n.report
            queue = report.waiting if report is not None else 0
            admitting += int(queue <= 0)
            waiting += max(0, queue)
        summary = Summary(len(nodes), admitting, waiting, now)
        for peer in SITES:
            if peer != site and not self.cut_off(site, peer, now):
                self.at(now + one_way(site, peer), self.summary_arrives, (peer, site, summary))
        self.at(now + SUMMARY_PERIOD_S, self.summarise, site)

    def summary_arrives(self, now: float, arg: tuple[str, str, Summary]) -> None:
        peer, site, summary = arg
        self.heard[peer][site] = (summary, now)

    def _offers_for(self, site: str) -> Callable[[str], list[SiteOffer]]:
        def offers(model: str) -> list[SiteOffer]:
            now = self.now
            out = []
            for peer, (s, arrived) in sorted(self.heard[site].items()):
                rtt = 2 * one_way(site, peer)
                fresh = now - arrived <= SUMMARY_PERIOD_S + rtt + FRESH_SLACK_S
                routable = not self.cut_off(site, peer, now)
                gateways = (f"gw.{peer}:7950",)
                out.append(
                    SiteOffer(
                        peer, gateways, routable, rtt, s.replicas, s.admitting, s.waiting, fresh
                    )
                )
            return out

        return offers

    now = 0.0

    def run_events(self) -> None:
        # ``ModelCore.run_events`` with the time kept for ``offers`` (which takes no ``now``).
        import heapq

        while self.events:
            now, _, what, arg = heapq.heappop(self.events)
            if now > self.end:
                break
            self.now = now
            what(now, arg)

    # -- the clients --

    def client_send(self, now: float, a: Arrival) -> None:
        self.token_seq += 1
        # Distinct prompts: the trace has lengths, not text, so no two share a prefix, but
        # for their tenant's system prompt (--tenants: tokens above 50,000, one run a tenant).
        base = self.token_seq * 7919
        system: list[int] = []
        if a.tenant >= 0:
            k = SITES.index(a.site) * self.args.tenants + a.tenant
            start = 50_001 + k * 397
            system = [(start + i) % 15_000 + 50_001 for i in range(self.args.system_tokens)]
        own = a.prompt - len(system)
        tokens = system[: a.prompt] + [(base + i) % 50_000 + 1 for i in range(max(0, own))]
        r = Req(a, tokens)
        if self.args.tenants:
            # the prompt as text, 4 characters a token (the ingress's estimate): a 64-character
            # block is the engine's 16-token block
            r.blocks = routing.prompt_blocks("".join(f"{t:04x}" for t in tokens[:4096]))
        ing = self.ingresses[a.site]
        if self.cut_off(a.site, ing.site, now):
            r.failed = True  # the client cannot reach its ingress
            self.done.append(r)
            return
        self.at(now + LAN_S + one_way(a.site, ing.site), self.arrive, (r, ing))

    # -- the ingresses --

    def candidates(self, ing: Ingress, now: float) -> list[routing.Candidate]:
        return [
            routing.Candidate(
                n.info, n.report, ing.inflight.get(n.sid, 0), ing.clocks.backlog(n.sid, now)
            )
            for n in ing.nodes
            if not self.cut_off(ing.site, n.site, now)
        ]

    def arrive(self, now: float, arg: tuple[Req, Ingress]) -> None:
        r, ing = arg
        r.ingress = ing
        r.arrived_at = now
        self.route(now, r)

    def route(self, now: float, r: Req) -> None:
        ing = r.ingress
        assert ing is not None
        a = r.arrival
        rreq = RouteRequest(MODEL, r.blocks, None, a.prompt)
        candidates = self.candidates(ing, now)
        if not candidates:
            r.failed = True
            self.done.append(r)
            return
        if self.policy_name == "round-robin":
            n = candidates[ing.turn % len(candidates)].node
            ing.turn += 1
            self.send(now, r, ing, n.session_id)
            return
        first = r.routed_at == 0.0 and not r.held
        allow = now < r.arrived_at + HOLD_MAX_S
        ranked = ing.policy.rank(rreq, candidates, now, allow_hold=allow)
        across = ing.across
        if across is not None and first and not r.pushed_to:
            # Two-layer routing: the product's push decision (``Ingress._dispatch`` asks
            # ``Across.push``, whose routes these are: ``may_go_out`` holds for every request
            # of this model at the site of its client).
            prompt = self.prompt(ing, rreq, ranked)
            if ranked is None:  # none of our replicas can admit it (rule 5)
                out = across.push_routes(MODEL, None, None, prompt)
            elif ranked[0].prefill_s > 0.0 or prompt is not None:  # rules 6 and 7
                out = across.quicker_routes(MODEL, None, None, ranked[0].prefill_s, prompt)
            else:
                out = []
            if out:
                self.pushes += 1
                ing.policy.on_routed(rreq, out[0].info.session_id, now)  # as the ingress does
                peer = out[0].info.site
                r.pushed_to = peer
                self.at(now + one_way(ing.site, peer), self.arrive, (r, self.ingresses[peer]))
                return
        if ranked is None:
            if r not in ing.held:
                ing.held.append(r)
                r.held = True
            if not r.retrying:
                r.retrying = True
                self.at(now + HOLD_RETRY_S, self.retry_held, r)
            return
        if r in ing.held:
            ing.held.remove(r)
        sid = ranked[0].node.session_id
        ing.policy.on_routed(rreq, sid, now)
        self.send(now, r, ing, sid)

    def prompt(
        self, ing: Ingress, rreq: RouteRequest, ranked: list[routing.Candidate] | None
    ) -> Prompt | None:
        """The prompt as a gateway prices it (``Ingress._prompt``, ``sites`` rule 7); None for
        ``ours-noprefix`` and for prompts of no whole block."""
        if self.policy_name != "ours" or not rreq.prefix_blocks:
            return None
        policy = ing.policy
        pick = ranked[0].node.session_id if ranked else ""
        rate = ing.clocks.rate(pick) if pick else ing.clocks.default_rate
        here = max((policy.held_blocks(rreq, c.node.session_id) for c in ranked or ()), default=0)
        return Prompt(
            len(rreq.prefix_blocks),
            here,
            routing.BLOCK_TOKENS_EST / rate,
            lambda sid: policy.held_blocks(rreq, sid),
        )

    def send(self, now: float, r: Req, ing: Ingress, sid: str) -> None:
        n = self.by_sid[sid]
        r.sid, r.routed_at, r.node_site = sid, now, n.site
        ing.inflight[sid] = ing.inflight.get(sid, 0) + 1
        r.sample = ing.clocks.sent(sid, r.arrival.prompt, now)
        r.due = ing.clocks.due(sid)
        r.back_s = LAN_S + one_way(n.site, ing.site) + one_way(ing.site, r.arrival.site) + LAN_S
        self.at(now + one_way(ing.site, n.site) + LAN_S, self.submit, r)

    def retry_held(self, now: float, r: Req) -> None:
        r.retrying = False
        if r.ingress is not None and r in r.ingress.held:
            self.route(now, r)

    # -- the engines --

    def submit(self, now: float, r: Req) -> None:
        n = self.by_sid[r.sid]
        r.rid = n.engine.submit(r.tokens, r.arrival.output, now)
        n.live[r.rid] = r
        self.step(n, now)

    def on_event(self, n: Node, r: Req, ev: TokenEvent, now: float) -> bool:
        ing = r.ingress
        assert ing is not None
        if ev.index == 0:
            r.ttft = now + r.back_s - r.arrival.t
            at_ingress = now + LAN_S + one_way(n.site, ing.site)
            ing.clocks.first_token(n.sid, r.due, at_ingress)
            if r.sample:
                ing.clocks.observe(n.sid, r.arrival.prompt, at_ingress - r.routed_at)
        if ev.finish_reason is None:
            return False
        n.engine.release(ev.request_id)
        del n.live[r.rid]
        ing.inflight[n.sid] -= 1
        r.e2e = now + r.back_s - r.arrival.t
        r.tokens = []
        self.done.append(r)
        return True

    def after_step(self, n: Node, ended: list[Req], now: float) -> None:
        for ing in {id(r.ingress): r.ingress for r in ended if r.ingress is not None}.values():
            for r in list(ing.held):
                self.route(now, r)

    # -- the outcome --

    def run(self) -> Outcome:
        self.run_events()
        a = self.args
        done = self.done
        objective = a.ttft_objective_s
        # A peaks at a sixth of the day: the sixth of the day around it
        peak = (a.day / 6 - a.day / 12, a.day / 6 + a.day / 12)
        served = [r for r in done if r.ttft is not None]
        within = [r for r in served if r.ttft is not None and r.ttft <= objective]
        total = len(self.arrivals)

        def in_peak(r: Req) -> bool:
            t = r.arrival.t
            return peak[0] <= t < peak[1]

        peak_all = [x for x in self.arrivals if peak[0] <= x.t < peak[1]]
        peak_within = [r for r in within if in_peak(r)]
        ttfts = sorted(r.ttft for r in served if r.ttft is not None)
        peak_ttfts = sorted(r.ttft for r in served if r.ttft is not None and in_peak(r))
        # A request never answered (still held or running at the end) has no TTFT: it is not
        # within the objective, and it counts in the quantiles as never answered.
        unanswered = total - len(served)
        e2es = sorted(r.e2e for r in done if r.e2e is not None)
        crossed = [r for r in served if r.node_site != r.arrival.site]
        wan = sum(
            REQUEST_ENVELOPE_BYTES + 4 * r.arrival.prompt + SSE_EVENT_BYTES * r.arrival.output
            for r in served
            for _ in range(_wan_crossings(self.policy_name, r))
        )
        by_site = {}
        for s in SITES:
            mine = [x for x in self.arrivals if x.site == s]
            ok = sum(1 for r in within if r.arrival.site == s)
            by_site[s] = ok / max(1, len(mine))
        peak_unanswered = len(peak_all) - len(peak_ttfts)
        return Outcome(
            policy=self.policy_name,
            replicas=self.replicas,
            requests=total,
            within=len(within) / max(1, total),
            good_per_s=len(within) / a.day,
            ttft_p50=_quantile(ttfts, 0.5, unanswered),
            ttft_p90=_quantile(ttfts, 0.9, unanswered),
            e2e_p50=_quantile(e2es, 0.5, total - len(e2es)),
            e2e_p90=_quantile(e2es, 0.9, total - len(e2es)),
            peak_within=len(peak_within) / max(1, len(peak_all)),
            peak_good_per_s=len(peak_within) / (peak[1] - peak[0]),
            peak_ttft_p50=_quantile(peak_ttfts, 0.5, peak_unanswered),
            peak_ttft_p90=_quantile(peak_ttfts, 0.9, peak_unanswered),
            failed=sum(1 for r in done if r.failed),
            crossed=len(crossed) / max(1, len(served)),
            wan_mb=wan / 1e6,
            within_by_site=by_site,
            cached=sum(n.engine.cache.hit_tokens for n in self.nodes)
            / max(1, sum(n.engine.cache.query_tokens for n in self.nodes)),
        )


def _wan_crossings(policy: str, r: Req) -> int:
    """How many WAN legs a request's body and answer each cross."""
    client, node = r.arrival.site, r.node_site
    if policy == "central":
        return int(client != "A") + int(node != "A")
    return int(client != node)


def _quantile(values: list[float], q: float, missing: int = 0) -> float:
    """The q-quantile of ``values`` plus ``missing`` values of infinity (never answered)."""
    n = len(values) + missing
    if n == 0:
        return float("nan")
    i = min(n - 1, max(0, int(q * n + 0.999999) - 1))
    return values[i] if i < len(values) else float("inf")


def spread(total: int) -> tuple[int, ...]:
    """``total`` replicas over the sites as evenly as they go (the first sites one more)."""
    base, extra = divmod(total, len(SITES))
    return tuple(base + (1 if i < extra else 0) for i in range(len(SITES)))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--policies",
        default="",
        help=f"comma-separated (all of {', '.join(POLICIES)}; with --tenants also {NO_PREFIX})",
    )
    p.add_argument("--replicas", type=int, default=4, help="replicas per site (4)")
    p.add_argument("--day", type=float, default=600.0, help="seconds the trace's hour takes")
    p.add_argument("--drain", type=float, default=60.0, help="seconds after the day (60)")
    p.add_argument("--scale", type=float, default=0.13, help="share of the trace kept at a peak")
    p.add_argument("--amplitude", type=float, default=0.6, help="the envelope's a (0.6)")
    p.add_argument("--ttft-objective-s", type=float, default=2.0)
    p.add_argument("--attain", type=float, default=0.95, help="--search's objective share")
    p.add_argument("--search", action="store_true", help="find the replicas each policy needs")
    p.add_argument("--cut", action="store_true", help="also the day with site A cut off")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--tenants",
        type=int,
        default=0,
        help="tenants a site, each request starting with its tenant's system prompt (0: none)",
    )
    p.add_argument("--system-tokens", type=int, default=2000, help="a system prompt's tokens")
    p.add_argument(
        "--routing",
        default="head",
        help="every ingress's RoutingConfig: head, or head+name=value+... (as routing_model.py)",
    )
    p.add_argument("--gpu", default="L4")
    p.add_argument("--params-b", type=float, default=8.0)
    p.add_argument("--kv-tokens", type=int, default=30_000)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--report-s", type=float, default=0.5, help="load report interval (0.5)")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="a short day (tests/system)")
    args = p.parse_args(argv)
    if args.quick:
        args.day, args.drain, args.scale = 60.0, 20.0, 0.013
    return args


HEADER = (
    f"{'policy':12} {'replicas':>9} {'within':>7} {'good/s':>7} {'TTFT p50':>9} {'p90':>7} "
    f"{'e2e p50':>8} {'p90':>7} | {'A peak: within':>14} {'good/s':>7} {'TTFT p50':>9} "
    f"{'p90':>7} | {'crossed':>7} {'WAN MB':>7} {'failed':>6} {'cached':>6}"
)


def row(o: Outcome) -> str:
    reps = "/".join(str(x) for x in o.replicas)
    return (
        f"{o.policy:12} {reps:>9} {100 * o.within:6.1f}% {o.good_per_s:7.2f} "
        f"{o.ttft_p50:9.3f} {o.ttft_p90:7.3f} {o.e2e_p50:8.2f} {o.e2e_p90:7.2f} | "
        f"{100 * o.peak_within:13.1f}% {o.peak_good_per_s:7.2f} {o.peak_ttft_p50:9.3f} "
        f"{o.peak_ttft_p90:7.3f} | {100 * o.crossed:6.1f}% {o.wan_mb:7.1f} {o.failed:6d} "
        f"{100 * o.cached:5.1f}%"
    )


def fewest(
    policy: str, trace_arrivals: list[Arrival], args: argparse.Namespace, start: int
) -> tuple[tuple[int, ...], Outcome]:
    """The fewest replicas (``spread``; site-local: per site) that answer ``--attain`` of the
    requests within the objective, searched from ``start`` per site: up while too few, then
    down while enough."""
    if policy == "local":
        # Sites do not share: each needs what its own day needs, found alone.
        counts = [start] * len(SITES)
        for k, site in enumerate(SITES):
            while True:
                o = Model(policy, tuple(counts), trace_arrivals, args, args.seed).run()
                if o.within_by_site[site] >= args.attain or counts[k] > 64:
                    break
                counts[k] += 1
            while counts[k] > 1:
                trial = list(counts)
                trial[k] -= 1
                o = Model(policy, tuple(trial), trace_arrivals, args, args.seed).run()
                if o.within_by_site[site] < args.attain:
                    break
                counts = trial
        final = tuple(counts)
        return final, Model(policy, final, trace_arrivals, args, args.seed).run()
    total = start * len(SITES)
    o = Model(policy, spread(total), trace_arrivals, args, args.seed).run()
    while o.within < args.attain and total < 64 * len(SITES):
        total += 1
        o = Model(policy, spread(total), trace_arrivals, args, args.seed).run()
    while total > 1:
        trial = Model(policy, spread(total - 1), trace_arrivals, args, args.seed).run()
        if trial.within < args.attain:
            break
        total, o = total - 1, trial
    return spread(total), o


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    trace = load_trace(args.trace, 0.0, 24 * 60)  # the whole trace
    arrivals = demand(trace, args, args.seed)
    policies = args.policies.split(",") if args.policies else list(POLICIES)
    if not args.policies and args.tenants:
        policies.append(NO_PREFIX)
    for p in policies:
        if p not in (*POLICIES, NO_PREFIX):
            raise SystemExit(f"unknown policy {p!r} (known: {', '.join(POLICIES)}, {NO_PREFIX})")
    per_site = {s: sum(1 for a in arrivals if a.site == s) for s in SITES}
    print(
        f"federation model: 3 sites (RTT A-B 40, A-C 150, B-C 250 ms), {args.gpu} "
        f"{args.params_b:g}B replicas, the trace's hour in a {args.day:g} s day, "
        f"envelope a={args.amplitude:g} x {args.scale:g}: "
        + ", ".join(f"{s} {n}" for s, n in per_site.items())
        + f" requests ({len(arrivals) / args.day:.2f}/s in all); TTFT objective "
        f"{args.ttft_objective_s:g} s"
    )
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    equal = tuple([args.replicas] * len(SITES))
    print(f"\nat {args.replicas} replicas a site:")
    print(HEADER)
    outs = {}
    for p in policies:
        o = Model(p, equal, arrivals, args, args.seed).run()
        outs[p] = o
        print(row(o), flush=True)
    results["equal"] = {p: o.__dict__ for p, o in outs.items()}
    if "local" in outs and "ours" in outs:
        lo, ou = outs["local"], outs["ours"]
        gain = ou.peak_good_per_s / max(1e-9, lo.peak_good_per_s)
        print(
            f"ours / local while A peaks: {gain:.2f}x "
            f"throughput within the objective, p90 TTFT "
            f"{lo.peak_ttft_p90 / max(1e-9, ou.peak_ttft_p90):.2f}x lower"
        )
    if "central" in outs and "ours" in outs:
        print(
            f"ours / central median TTFT over the day: "
            f"{outs['ours'].ttft_p50 / max(1e-9, outs['central'].ttft_p50):.2f}x"
        )
    if args.cut:
        cut = (0.45 * args.day, 0.55 * args.day)
        print(f"\nsite A cut off from B and C from {cut[0]:g} s to {cut[1]:g} s:")
        print(HEADER)
        cut_outs = {}
        for p in policies:
            o = Model(p, equal, arrivals, args, args.seed, cut=cut).run()
            cut_outs[p] = o
            print(row(o), flush=True)
        results["cut"] = {p: o.__dict__ for p, o in cut_outs.items()}
    if args.search:
        print(f"\nthe fewest replicas answering {100 * args.attain:g}% within the objective:")
        print(HEADER)
        found = {}
        for p in policies:
            counts, o = fewest(p, arrivals, args, args.replicas)
            found[p] = counts
            print(row(o), flush=True)
        results["fewest"] = {p: list(c) for p, c in found.items()}
        if "local" in found and "ours" in found:
            lo_n, ou_n = sum(found["local"]), sum(found["ours"])
            print(f"ours needs {ou_n} replicas, local {lo_n}: {100 * (1 - ou_n / lo_n):.0f}% fewer")
    print(ATTRIBUTION)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
