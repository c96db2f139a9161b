"""``bench/tiers.py`` as a model: its cells without processes or sockets, a few seconds each, to
try a policy before spending a live run on it. The live bench is the measurement; this is where
to look first.

What is real: the ingress's own pure code, the routing policy and its load scores
(``routing``), the prefill clocks with their learned rate and first-token corrections
(``prefill``), the batch tier's room rules (``tiers.has_room``), and two of the simulated
engine's pure schedulers (``simengine.model.Scheduler``: priority scheduling, KV blocks,
preemption, roofline step times), fed by the same trace slice and batch line lengths.

What is modelled, after ``Ingress``: an interactive request is routed when it arrives (a HOLD
asks again when a request ends or 50 ms later, pushed past ``hold_max_s``); this ingress's batch
requests on the nodes are hidden from it; a batch line goes to a node with room and nothing on
its prefill clock, one walk of the gate at a time (when a request ends, a clock runs out, a
report comes, or every 0.1 s), and is taken back when a report shows the engine queueing with
its KV cache 90% full. Each engine's load report is taken every ``--report-s`` from a random
phase and reaches the ingress 5 ms later. The network is 2 ms each way; the host costs nothing
(the live bench shares two cores between every process, which adds ~0.02 s to its p95).

    python bench/tiers_model.py                       # interactive, tiered, greedy; 5 seeds
    python bench/tiers_model.py --cells interactive,tiered+kv0.7 --seeds 8
    python bench/tiers_model.py --pending-waiting-threshold 0   # the hold rule before 2399de0

Cells are named as in ``bench/tiers.py`` (``tiered@CAP+kvK``). Each seed changes the reports'
phases, the batch lines drawn and the prompts' token ids; figures are medians over the seeds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for _path in (str(REPO), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _model_core import EngineNode, ModelCore, engine_nodes  # noqa: E402
from tiers import ATTRIBUTION, TRACE, VOCAB, Request, load_trace  # noqa: E402

# How often the modelled gate looks for room. The ingress's gate wakes on events (a load
# report arriving, a batch request ending) and on its own deadlines (dataplane/gate.py); it
# ticked every 0.1 s before, and the model keeps that tick: at most as late as the ingress.
GATE_TICK_S = 0.1

from fabricnode.dataplane.ingress_config import IngressConfig  # noqa: E402
from fabricnode.dataplane.prefill import PrefillClocks  # noqa: E402
from fabricnode.dataplane.routing import (  # noqa: E402
    Candidate,
    LoadSnapshot,
    RouteRequest,
    RoutingConfig,
    make_policy,
)
from fabricnode.dataplane.tiers import RoomRules, has_room  # noqa: E402
from fabricnode.simengine.model import EngineConfig, TokenEvent, gpu_profile  # noqa: E402

NET_S = 0.002  # one way
HOLD_RETRY_S = 0.05  # Ingress._hold asks again at least this often
# The ingress's own defaults, so the model follows them.
HOLD_MAX_S = IngressConfig().hold_max_s
PREEMPT_KV = IngressConfig().batch_preempt_kv_threshold
PREEMPT_PER_REPORT = IngressConfig().batch_preempt_per_report
TEMPLATE_TOKENS = 4  # the simulated engine's chat template around the words
BATCH_CONCURRENCY = 64
BATCH_LINES = 20_000
MAX_BATCH_PROMPT = 4096
WINDOW_FROM_S = 30.0
# The ingress estimates a prompt as its body's bytes / 4: the words and a space each, plus the
# rest of the JSON body.
BYTES_PER_WORD = statistics.mean(len(w) + 1 for w in VOCAB)
BODY_OVERHEAD_BYTES = 90


def estimated_tokens(words: int) -> int:
    return int((words * BYTES_PER_WORD + BODY_OVERHEAD_BYTES) / 4)


@dataclass(eq=False)
class Req:
    arrived: float
    words: int
    output: int
    batch: bool  # of the batch tier
    line: bool  # a batch line (the batch tier's, or greedy's sent as an ordinary request)
    sid: str = ""
    rid: int = -1
    sent: float = 0.0
    due: float = 0.0
    sample: bool = False
    ttft: float | None = None
    retrying: bool = False  # held, with a retry scheduled


@dataclass
class Node(EngineNode[Req]):
    preempted_report: float = -1.0  # the time of the report its last preemption answered


@dataclass(frozen=True)
class Cell:
    name: str
    mode: str  # interactive | tiered | greedy
    cap: int = IngressConfig().batch_max_inflight_per_node
    kv: float = IngressConfig().batch_kv_threshold


def parse_cell(name: str) -> Cell:
    """A cell name: interactive, greedy, tiered, tiered@CAP, tiered+kvK or tiered@CAP+kvK."""
    base, _, kv = name.partition("+kv")
    mode, _, cap = base.partition("@")
    if mode not in ("interactive", "tiered", "greedy"):
        raise ValueError(f"unknown cell {name!r}")
    default = Cell(name, mode)
    return Cell(name, mode, int(cap) if cap else default.cap, float(kv) if kv else default.kv)


@dataclass(frozen=True)
class Outcome:
    ttft_p50: float
    ttft_p95: float
    batch_per_s: float
    held: int  # interactive requests held at the ingress at least once


class Model(ModelCore[Node, Req]):
    """One cell, one seed."""

    def __init__(self, cell: Cell, trace: list[Request], args: argparse.Namespace, seed: int):
        self.cell = cell
        self.args = args
        self.rng = random.Random(seed)
        config = EngineConfig(
            model="sim-8b",
            gpu=gpu_profile(args.gpu),
            params_b=8,
            kv_tokens=args.kv_tokens,
            scheduling_policy="priority",
        )
        nodes = engine_nodes(args.nodes, args.gpu, config, Node)
        super().__init__(nodes, args.minutes * 60.0, args.report_s)
        routing = RoutingConfig(pending_waiting_threshold=args.pending_waiting_threshold)
        self.policy = make_policy("prefix-pending", config=routing)
        self.clocks = PrefillClocks()
        self.rules = RoomRules(kv_threshold=cell.kv, max_inflight=cell.cap)
        self.inflight: dict[str, int] = {}
        self.batch_inflight: dict[str, int] = {}
        self.gate: list[Req] = []
        self.held: list[Req] = []
        self.ever_held: set[int] = set()
        self.answered: list[Req] = []
        self.lines_done: list[float] = []
        lines_rng = random.Random(seed)
        self.lines = iter(
            [
                (min(s.prompt, MAX_BATCH_PROMPT), s.output)
                for s in (lines_rng.choice(trace) for _ in range(BATCH_LINES))
            ]
        )
        for r in trace:
            self.at(r.at_s, self.arrive, Req(r.at_s, r.prompt, r.output, False, False))
        for n in self.nodes:
            self.at(self.rng.uniform(0, args.report_s), self.take_report, n)

    def run(self) -> Outcome:
        if self.cell.mode != "interactive":
            for _ in range(BATCH_CONCURRENCY):
                self.next_line(0.0)
        if self.cell.mode == "tiered":
            self.at(GATE_TICK_S, self.tick)
        self.run_events()
        window = [
            r.ttft for r in self.answered if r.arrived >= WINDOW_FROM_S and r.ttft is not None
        ]
        window.sort()
        done = sum(1 for t in self.lines_done if WINDOW_FROM_S <= t <= self.end)
        return Outcome(
            window[len(window) // 2],
            window[int(0.95 * len(window))],
            done / (self.end - WINDOW_FROM_S),
            sum(1 for r in self.answered if id(r) in self.ever_held),
        )

    # -- the ingress --

    def candidates(self, now: float, interactive: bool) -> list[Candidate]:
        out = []
        for n in self.nodes:
            c = Candidate(
                n.info, n.report, self.inflight.get(n.sid, 0), self.clocks.backlog(n.sid, now)
            )
            if interactive and not self.args.no_hide:
                c.hidden = self.batch_inflight.get(n.sid, 0)
            out.append(c)
        return out

    def send(self, r: Req, sid: str, now: float) -> None:
        r.sid, r.sent = sid, now
        self.inflight[sid] = self.inflight.get(sid, 0) + 1
        r.sample = self.clocks.sent(sid, estimated_tokens(r.words), now, r.batch)
        r.due = self.clocks.due(sid)
        self.at(now + NET_S, self.submit, r)

    def arrive(self, now: float, r: Req) -> None:
        rreq = RouteRequest("m", (), None, estimated_tokens(r.words))
        ranked = self.policy.rank(
            rreq, self.candidates(now, True), now, allow_hold=now < r.arrived + HOLD_MAX_S
        )
        if ranked is None:
            if r not in self.held:
                self.held.append(r)
                self.ever_held.add(id(r))
            if not r.retrying:
                r.retrying = True
                self.at(now + HOLD_RETRY_S, self.retry_held, r)
            return
        if r in self.held:
            self.held.remove(r)
        self.send(r, ranked[0].node.session_id, now)

    def retry_held(self, now: float, r: Req) -> None:
        r.retrying = False
        if r in self.held:
            self.arrive(now, r)

    def next_line(self, now: float) -> None:
        words, output = next(self.lines)
        tiered = self.cell.mode == "tiered"
        r = Req(now, words, output, tiered, True)
        if tiered:
            self.gate.append(r)
            self.walk_gate(now)
        else:
            self.arrive(now, r)

    def admit(self, r: Req, now: float) -> bool:
        roomy = [
            c
            for c in self.candidates(now, False)
            if has_room(c.load, self.batch_inflight.get(c.node.session_id, 0), now, self.rules)
            and c.prefill_s <= 0.0
        ]
        if not roomy:
            return False
        if len(roomy) > 1:
            rreq = RouteRequest("m", (), None, estimated_tokens(r.words))
            ranked = self.policy.rank(rreq, roomy, now, allow_hold=False) or roomy
        else:
            ranked = roomy
        sid = ranked[0].node.session_id
        self.batch_inflight[sid] = self.batch_inflight.get(sid, 0) + 1
        self.send(r, sid, now)
        return True

    def walk_gate(self, now: float, _: Any = None) -> None:
        while self.gate and self.admit(self.gate[0], now):
            self.gate.pop(0)

    def tick(self, now: float, _: Any = None) -> None:
        self.walk_gate(now)
        self.at(now + GATE_TICK_S, self.tick)

    def deliver_report(self, now: float, arg: tuple[Node, LoadSnapshot]) -> None:
        super().deliver_report(now, arg)
        n, report = arg
        if self.cell.mode != "tiered":
            return
        if report.waiting > 0 and report.kv_usage >= PREEMPT_KV and report.at > n.preempted_report:
            n.preempted_report = report.at
            batch = sorted((r for r in n.live.values() if r.batch), key=lambda r: -r.sent)
            for r in batch[: min(report.waiting, PREEMPT_PER_REPORT)]:
                n.engine.abort(r.rid)
                self.ended(n, r)
                self.gate.insert(0, Req(now, r.words, r.output, True, True))
        self.walk_gate(now)

    def ended(self, n: Node, r: Req) -> None:
        del n.live[r.rid]
        self.inflight[n.sid] -= 1
        if r.batch:
            self.batch_inflight[n.sid] -= 1

    # -- the engines --

    def submit(self, now: float, r: Req) -> None:
        n = self.by_sid[r.sid]
        prompt = [self.rng.randrange(32_000) for _ in range(r.words + TEMPLATE_TOKENS)]
        r.rid = n.engine.submit(prompt, r.output, now, priority=1 if r.batch else 0)
        n.live[r.rid] = r
        self.step(n, now)

    def on_event(self, n: Node, r: Req, ev: TokenEvent, now: float) -> bool:
        if ev.index == 0:
            first = now + NET_S
            r.ttft = first - r.arrived
            if not r.batch:  # only streams tell the ingress their first token
                self.clocks.first_token(n.sid, r.due, first)
                if r.sample:
                    self.clocks.observe(n.sid, estimated_tokens(r.words), first - r.sent)
        if ev.finish_reason is None:
            return False
        n.engine.release(ev.request_id)
        self.ended(n, r)
        if r.line:
            self.lines_done.append(now)
            self.next_line(now)
        else:
            self.answered.append(r)
        return True

    def after_step(self, n: Node, ended: list[Req], now: float) -> None:
        if ended:
            for r in list(self.held):
                self.arrive(now, r)
            if self.cell.mode == "tiered":
                self.walk_gate(now)
        if self.cell.mode == "tiered":
            soonest = self.clocks.soonest_end(now)
            if soonest is not None:
                self.at(soonest, self.walk_gate)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cells", default="interactive,tiered,greedy")
    p.add_argument("--seeds", type=int, default=5, help="runs per cell, seeds 1..N (5)")
    p.add_argument("--minutes", type=float, default=4.0, help="trace minutes replayed (4)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpu", default="A100-40G")
    p.add_argument("--kv-tokens", type=int, default=60000)
    p.add_argument("--report-s", type=float, default=0.5, help="load report interval (0.5)")
    p.add_argument(
        "--pending-waiting-threshold",
        type=int,
        default=RoutingConfig().pending_waiting_threshold,
        help="routing's queue length that closes a node to the pending-aware policy",
    )
    p.add_argument(
        "--no-hide", action="store_true", help="interactive routing counts batch requests too"
    )
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--json", type=Path, help="also write the per-cell medians here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cells = [parse_cell(c) for c in args.cells.split(",") if c]
    trace = load_trace(args.trace, 0.0, args.minutes)
    print(f"{len(trace)} trace requests, {args.seeds} seeds per cell, reports every "
          f"{args.report_s:g} s, pending waiting threshold {args.pending_waiting_threshold}"
          f"{', batch not hidden' if args.no_hide else ''}")  # fmt: skip
    results: dict[str, list[Outcome]] = {}
    for cell in cells:
        results[cell.name] = [
            Model(cell, trace, args, seed).run() for seed in range(1, args.seeds + 1)
        ]
    alone = results.get("interactive")
    greedy = results.get("greedy")
    base_p95 = statistics.median(o.ttft_p95 for o in alone) if alone else None
    base_rate = statistics.median(o.batch_per_s for o in greedy) if greedy else None
    print(f"{'cell':<18} {'TTFT p50':>8} {'TTFT p95':>8} {'(per seed)':<44} {'batch/s':>7} "
          f"{'held':>5} {'p95/alone':>9} {'vs greedy':>9}")  # fmt: skip
    for name, outs in results.items():
        p95 = statistics.median(o.ttft_p95 for o in outs)
        rate = statistics.median(o.batch_per_s for o in outs)
        seeds = " ".join(f"{o.ttft_p95:.3f}" for o in outs)
        ratio = f"{p95 / base_p95:.3f}" if base_p95 else "-"
        share = f"{rate / base_rate:.0%}" if base_rate and name != "interactive" else "-"
        print(f"{name:<18} {statistics.median(o.ttft_p50 for o in outs):8.3f} {p95:8.3f} "
              f"{seeds[:44]:<44} {rate:7.2f} {statistics.median(o.held for o in outs):5.0f} "
              f"{ratio:>9} {share:>9}")  # fmt: skip
    print(ATTRIBUTION)
    if args.json:
        rows = [
            {
                "cell": name,
                "ttft_p50_s": statistics.median(o.ttft_p50 for o in outs),
                "ttft_p95_s": statistics.median(o.ttft_p95 for o in outs),
                "ttft_p95_per_seed_s": [o.ttft_p95 for o in outs],
                "batch_lines_per_s": statistics.median(o.batch_per_s for o in outs),
                "held": statistics.median(o.held for o in outs),
            }
            for name, outs in results.items()
        ]
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"trace": str(args.trace), "json": str(args.json)},
                    "cells": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
