"""``bench/routing.py`` as a model: its closed-loop workloads against the ingress's own routing
code and the simulated engine's own scheduler, without processes or sockets, a few seconds per
cell, deterministic for a seed. The live bench is the measurement; this is where to look first,
and where a routing change can be tried knob by knob without two shared cores' noise. Each seed
runs other programs of the workload and other report phases, and the spread between seeds is
large (a closed loop amplifies one early decision): compare configurations by mean and sd
over seeds, never by one seed.

What is real: the workloads (``bench/_routing_workloads.py``: the very programs the live bench's
clients run), the ingress's request estimate (the JSON body's bytes / 4) and prefix hashing
(``request.prompt_text``, ``routing.prompt_blocks``), the routing policy with its load scores
and prefix index (``routing``), the prefill clocks with their learned rate and first-token
corrections (``prefill``), and one simulated engine scheduler per node
(``simengine.model.Scheduler``: continuous batching, KV blocks, the block prefix cache,
preemption, roofline step times, the live bench's defaults).

What is modelled, after ``Ingress``: a request is routed when its client sends it; a HOLD asks
again when one of this ingress's requests ends or 50 ms later, and is pushed past
``hold_max_s``. Each engine's load report is taken every ``--report-s`` from a random phase and
reaches the ingress 5 ms later. The network is 2 ms each way; the host costs nothing. An answer's
words are drawn from the seed (the engines' text does not matter to routing, only its length).

    python bench/routing_model.py                                  # shared-prompts, both configs
    python bench/routing_model.py --workloads shared-prompts,tot --seeds 5
    python bench/routing_model.py --configs head,prefill_weight=0,pending_waiting_threshold=0

A config is ``head`` (this checkout's ``RoutingConfig()``), or ``head`` with ``name=value``
overrides of ``RoutingConfig`` fields joined by ``+``
(``prefill_weight=0+pending_waiting_threshold=0``); ``--policy`` picks the policy (default:
the ingress's default).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for _path in (str(REPO), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import orjson  # noqa: E402
from _model_core import EngineNode, ModelCore, engine_nodes  # noqa: E402
from _routing_workloads import (  # noqa: E402
    TRACE_ATTRIBUTION,
    WORKLOADS,
    Call,
    SharedPrompts,
    Workload,
)

from fabricnode.dataplane import routing  # noqa: E402
from fabricnode.dataplane.ingress_config import IngressConfig  # noqa: E402
from fabricnode.dataplane.prefill import PrefillClocks  # noqa: E402
from fabricnode.dataplane.request import CHAT, prompt_text  # noqa: E402
from fabricnode.simengine.model import EngineConfig, TokenEvent, gpu_profile, tokenize  # noqa: E402

MODEL = "sim-8b"
NET_S = 0.002  # one way
HOLD_RETRY_S = 0.05  # Ingress._hold asks again at least this often
HOLD_MAX_S = IngressConfig().hold_max_s
TEMPLATE_TOKENS = 4  # the simulated engine's chat template around the words
TRACE = REPO.parent / "shared" / "data" / "azure-llm-2023-conv.csv"


@dataclass(eq=False)
class Req:
    call: Call
    sent_at: float  # when the client sent it
    body_tokens: int  # the ingress's estimate
    blocks: tuple[int, ...]
    tokens: list[int]
    ingress: Ingress
    charged: int = 0  # the tokens its node's prefill clock was charged
    sid: str = ""
    rid: int = -1
    routed_at: float = 0.0
    due: float = 0.0
    sample: bool = False
    ttft: float | None = None
    ended_at: float | None = None
    retrying: bool = False
    held: bool = False
    answer: str = ""


class Node(EngineNode[Req]):
    """A node whose requests are this model's ``Req``."""


@dataclass
class Ingress:
    """What one ingress keeps: its policy (with its prefix index), its prefill clocks, its
    requests in flight per node and the requests it holds."""

    policy: routing.Policy
    clocks: PrefillClocks = field(default_factory=PrefillClocks)
    inflight: dict[str, int] = field(default_factory=dict)
    held: list[Req] = field(default_factory=list)


@dataclass(frozen=True)
class Outcome:
    req_s: float
    ttft_p50: float
    ttft_p90: float
    hit_rate: float
    held: int
    spread: tuple[float, ...]


class Model(ModelCore[Node, Req]):
    """One (workload, config, seed) cell."""

    def __init__(
        self, workload: Workload, config: routing.RoutingConfig, args: argparse.Namespace, seed: int
    ) -> None:
        self.workload = workload
        self.args = args
        self.rng = random.Random(seed)
        engine = EngineConfig(
            model=MODEL,
            gpu=gpu_profile(args.gpu),
            params_b=args.params_b,
            kv_tokens=args.kv_tokens,
            max_num_seqs=args.max_num_seqs,
        )
        nodes = engine_nodes(args.nodes, args.gpu, engine, Node)
        super().__init__(nodes, args.warmup + args.seconds, args.report_s)
        self.config = config
        # One ingress (the live bench's ingress agent) or one per serving agent (``--via
        # agents``: client c talks to agent c mod nodes), each with its own policy state.
        count = args.nodes if args.via == "agents" else 1
        self.ingresses = [
            Ingress(routing.make_policy(args.policy, config=config)) for _ in range(count)
        ]
        self.done: list[Req] = []
        self._leaves: dict[tuple[int, int], int] = {}
        self.hits0 = self.queries0 = 0
        for c in range(args.clients):
            delay = args.warmup * c / max(1, args.clients)
            self.at(delay, self.start_program, (c, 0))
        for n in self.nodes:
            self.at(self.rng.uniform(0, args.report_s), self.take_report, n)
        self.at(args.warmup, self.window_opens)

    def run(self) -> Outcome:
        self.run_events()
        a = self.args
        window = [r for r in self.done if r.ended_at is not None and a.warmup <= r.ended_at]
        ttfts = sorted(r.ttft for r in window if r.ttft is not None)
        hits = sum(n.engine.statistics().prefix_cache_hits for n in self.nodes) - self.hits0
        queries = sum(n.engine.statistics().prefix_cache_queries for n in self.nodes)
        queries -= self.queries0
        served = [sum(1 for r in window if r.sid == n.sid) for n in self.nodes]
        return Outcome(
            req_s=len(window) / a.seconds,
            ttft_p50=_quantile(ttfts, 0.5),
            ttft_p90=_quantile(ttfts, 0.9),
            hit_rate=hits / queries if queries else float("nan"),
            held=sum(1 for r in window if r.held),
            spread=tuple(100.0 * s / max(1, len(window)) for s in served),
        )

    def window_opens(self, now: float, _: Any = None) -> None:
        self.hits0 = sum(n.engine.statistics().prefix_cache_hits for n in self.nodes)
        self.queries0 = sum(n.engine.statistics().prefix_cache_queries for n in self.nodes)

    # -- the clients --

    def start_program(self, now: float, arg: tuple[int, int]) -> None:
        client, program = arg
        self.client_send(now, self.workload.first(client, program))

    def client_send(self, now: float, call: Call) -> None:
        doc = {"model": MODEL, "messages": list(call.messages), "max_tokens": call.max_tokens}
        doc["stream"] = True
        body = orjson.dumps(doc)
        text = prompt_text(doc, CHAT)
        blocks = routing.prompt_blocks(
            text,
            block_chars=self.config.prefix_block_chars,
            max_blocks=self.config.prefix_max_blocks,
        )
        words = " ".join(m["content"] for m in call.messages)
        tokens = tokenize(words) + [0] * TEMPLATE_TOKENS
        ingress = self.ingresses[call.client % len(self.ingresses)]
        r = Req(call, now, len(body) // 4, blocks, tokens, ingress)
        self.at(now + NET_S, self.arrive, r)

    def answered(self, now: float, r: Req) -> None:
        self.done.append(r)
        call = r.call
        follow = self.workload.follow(call, r.answer)
        if follow:
            for child in follow:
                self.client_send(now, child)
        elif isinstance(self.workload, _Trees):
            self._tree_leaf_done(now, call)
        else:
            self.start_program(now, (call.client, call.program + 1))

    def _tree_leaf_done(self, now: float, call: Call) -> None:
        # A tree's program ends when its last leaf answers: count leaves per (client, program).
        key = (call.client, call.program)
        shape = self.workload.shape
        leaves = shape.branches ** (shape.depth - 1)
        self._leaves[key] = self._leaves.get(key, 0) + 1
        if self._leaves[key] == leaves:
            del self._leaves[key]
            self.start_program(now, (call.client, call.program + 1))

    # -- the ingress --

    def candidates(self, ing: Ingress, now: float) -> list[routing.Candidate]:
        return [
            routing.Candidate(
                n.info, n.report, ing.inflight.get(n.sid, 0), ing.clocks.backlog(n.sid, now)
            )
            for n in self.nodes
        ]

    def arrive(self, now: float, r: Req) -> None:
        ing = r.ingress
        rreq = routing.RouteRequest(MODEL, r.blocks, r.call.session, r.body_tokens)
        ranked = ing.policy.rank(
            rreq, self.candidates(ing, now), now, allow_hold=now < r.sent_at + NET_S + HOLD_MAX_S
        )
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
        r.charged = r.body_tokens  # the ingress charges a node's clock the whole prompt
        ing.policy.on_routed(rreq, sid, now)
        r.sid, r.routed_at = sid, now
        ing.inflight[sid] = ing.inflight.get(sid, 0) + 1
        r.sample = ing.clocks.sent(sid, r.charged, now)
        r.due = ing.clocks.due(sid)
        self.at(now + NET_S, self.submit, r)

    def retry_held(self, now: float, r: Req) -> None:
        r.retrying = False
        if r in r.ingress.held:
            self.arrive(now, r)

    # -- the engines --

    def submit(self, now: float, r: Req) -> None:
        n = self.by_sid[r.sid]
        r.rid = n.engine.submit(r.tokens, r.call.max_tokens, now)
        n.live[r.rid] = r
        self.step(n, now)

    def on_event(self, n: Node, r: Req, ev: TokenEvent, now: float) -> bool:
        if ev.index == 0:
            first = now + NET_S
            r.ttft = first + NET_S - r.sent_at
            clocks = r.ingress.clocks
            clocks.first_token(n.sid, r.due, first)
            if r.sample:
                clocks.observe(n.sid, r.charged, first - r.routed_at)
        if ev.finish_reason is None:
            return False
        n.engine.release(ev.request_id)
        del n.live[r.rid]
        r.ingress.inflight[n.sid] -= 1
        r.ended_at = now + 2 * NET_S
        c = r.call
        r.answer = self.workload.words(c.max_tokens, "answer", c.client, c.program, c.path)
        return True

    def after_step(self, n: Node, ended: list[Req], now: float) -> None:
        for r in ended:
            self.at(r.ended_at, self.answered, r)
        for ing in {id(r.ingress): r.ingress for r in ended}.values():
            for r in list(ing.held):
                self.arrive(now, r)


class _Trees:
    """Marker: workloads whose programs are trees (a program ends at its last leaf)."""


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, int(q * len(values) + 0.999999) - 1))]


def make_workload(name: str, seed: int) -> Workload:
    cls = WORKLOADS[name]
    if name in ("tot", "nosharing"):
        cls = type(cls.__name__, (cls, _Trees), {})
    return cls(seed=seed)


def parse_config(text: str) -> routing.RoutingConfig:
    base = routing.RoutingConfig()
    if text == "head":
        return base
    fields = {f.name: f for f in dataclasses.fields(base)}
    changes: dict[str, Any] = {}
    for part in text.removeprefix("head+").split("+"):
        name, _, value = part.partition("=")
        if name not in fields:
            raise SystemExit(f"unknown RoutingConfig field {name!r}")
        current = getattr(base, name)
        changes[name] = type(current)(float(value)) if not isinstance(current, str) else value
    return dataclasses.replace(base, **changes)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workloads", default="shared-prompts")
    p.add_argument(
        "--configs",
        default="head,prefill_weight=0+pending_waiting_threshold=0",
        help="comma-separated; see above",
    )
    p.add_argument("--policy", default=routing.DEFAULT_POLICY)
    p.add_argument(
        "--via",
        choices=("ingress", "agents"),
        default="ingress",
        help="clients talk to one ingress, or each to one of the serving agents",
    )
    p.add_argument("--seeds", type=int, default=6, help="runs per cell, seeds 1..N (6)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--warmup", type=float, default=8.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--gpu", default="L4")
    p.add_argument("--params-b", type=float, default=8.0)
    p.add_argument("--kv-tokens", type=int, default=30_000)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--report-s", type=float, default=0.5, help="load report interval (0.5)")
    p.add_argument("--trace", type=Path, default=TRACE)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    workloads = args.workloads.split(",")
    if "shared-prompts" in workloads:
        SharedPrompts.load_trace(str(args.trace))
    print(
        f"routing model: {args.nodes} x {args.gpu}, {args.clients} closed-loop clients, "
        f"{args.warmup:g} s warm-up + {args.seconds:g} s, policy {args.policy}; mean±sd over "
        f"{args.seeds} seeds (each seed: other programs and report phases)"
    )
    print(
        f"{'workload':15} {'config':45} {'req/s':>11} {'TTFT p50':>12} {'p90':>12} "
        f"{'hit rate':>12} {'held':>5}"
    )
    for name in workloads:
        for text in args.configs.split(","):
            config = parse_config(text)
            outs = [
                Model(make_workload(name, seed - 1), config, args, seed).run()
                for seed in range(1, args.seeds + 1)
            ]

            def mean_sd(attr: str, outs: list[Outcome] = outs) -> str:
                values = [getattr(o, attr) for o in outs]
                sd = statistics.stdev(values) if len(values) > 1 else 0.0
                return f"{statistics.fmean(values):.3g}±{sd:.2g}"

            print(
                f"{name:15} {text:45} {mean_sd('req_s'):>11} {mean_sd('ttft_p50'):>12} "
                f"{mean_sd('ttft_p90'):>12} {mean_sd('hit_rate'):>12} "
                f"{statistics.fmean(o.held for o in outs):5.0f}",
                flush=True,
            )
    if "shared-prompts" in workloads:
        print(TRACE_ATTRIBUTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
