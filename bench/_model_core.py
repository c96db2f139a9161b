"""The discrete-event driver the bench models share (``routing_model.py``, ``tiers_model.py``).

One event queue in simulated seconds (``at``; ties in the order they were scheduled), the
simulated engines stepped one step at a time (``step``, ``stepped``) and their load reports
taken every ``report_s`` and delivered ``REPORT_DELAY_S`` later (``take_report``,
``deliver_report``). A model subclasses ``ModelCore`` and says what a token event means to it
(``on_event``) and what follows a step (``after_step``); ``run_events`` runs the queue until
``end``. Deterministic: the same calls in the same order give the same queue.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from fabricnode.dataplane.routing import LoadSnapshot, NodeInfo
from fabricnode.simengine.model import EngineConfig, Scheduler, Step, TokenEvent

REPORT_DELAY_S = 0.005  # a load report reaches the ingress this long after it was taken

R = TypeVar("R")


@dataclass
class EngineNode(Generic[R]):
    """One node: its routing info, its engine, whether a step is under way, the last load
    report the ingress has of it, and its requests by the engine's id."""

    sid: str
    info: NodeInfo
    engine: Scheduler
    stepping: bool = False
    report: LoadSnapshot | None = None
    live: dict[int, R] = field(default_factory=dict)


def node_info(sid: str, gpu: str) -> NodeInfo:
    """A serving node of model ``p``'s provider with one ``gpu`` and an 8,192-token context."""
    return NodeInfo(sid, f"http://{sid}", "p", None, None, gpu, 1, 8192, None)


N = TypeVar("N", bound=EngineNode[Any])


class ModelCore(Generic[N, R]):
    """The event queue, the engines' steps and the load reports of one model run."""

    def __init__(self, nodes: list[N], end: float, report_s: float) -> None:
        self.nodes = nodes
        self.by_sid = {n.sid: n for n in nodes}
        self.end = end
        self.report_s = report_s
        self.events: list[tuple[float, int, Callable[..., None], Any]] = []
        self.seq = itertools.count()

    def at(self, t: float, what: Callable[..., None], arg: Any = None) -> None:
        heapq.heappush(self.events, (t, next(self.seq), what, arg))

    def run_events(self) -> None:
        """Every event up to ``end``, in time order."""
        while self.events:
            now, _, what, arg = heapq.heappop(self.events)
            if now > self.end:
                break
            what(now, arg)

    # -- the engines --

    def step(self, n: N, now: float) -> None:
        if n.stepping:
            return
        step = n.engine.step(now)
        if step is not None:
            n.stepping = True
            self.at(step.ends_at, self.stepped, (n, step))

    def stepped(self, now: float, arg: tuple[N, Step]) -> None:
        n, step = arg
        n.stepping = False
        ended: list[R] = []
        for ev in step.events:
            r = n.live.get(ev.request_id)
            if r is not None and self.on_event(n, r, ev, now):
                ended.append(r)
        self.step(n, now)
        self.after_step(n, ended, now)

    def on_event(self, n: N, r: R, ev: TokenEvent, now: float) -> bool:
        """A token of ``r`` at the end of a step; True if it was its last."""
        raise NotImplementedError

    def after_step(self, n: N, ended: list[R], now: float) -> None:
        """What follows a step, once the node's next one is under way."""

    # -- the load reports --

    def take_report(self, now: float, n: N) -> None:
        s = n.engine.statistics()
        report = LoadSnapshot(s.waiting, s.running, s.kv_cache_usage, s.waiting + s.running, now)
        self.at(now + REPORT_DELAY_S, self.deliver_report, (n, report))
        self.at(now + self.report_s, self.take_report, n)

    def deliver_report(self, now: float, arg: tuple[N, LoadSnapshot]) -> None:
        n, report = arg
        n.report = report


def engine_nodes(
    count: int, gpu: str, config: EngineConfig, node: Callable[[str, NodeInfo, Scheduler], N]
) -> list[N]:
    """``count`` nodes ``n0``, ``n1``, ... each with its own engine of ``config``."""
    return [node(f"n{i}", node_info(f"n{i}", gpu), Scheduler(config)) for i in range(count)]
