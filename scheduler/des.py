"""Discrete-event simulation of a placement: continuous batching on every replica.

Rules:

* Deterministic: arrivals and lengths come from ``random.Random`` seeded by ``(seed, model)``
  (adding a model does not change another model's requests); routing ties break by replica
  order; the ``random`` router has its own seeded stream.
* Arrivals are Poisson at each workload's rate during ``[0, duration_s)``; lengths are
  ``round(normal)`` clipped to ``[1, max_context - 1]`` (workload.sample_length). Requests that
  arrive from ``warmup_s`` on are measured. After the last arrival the simulation runs at most
  ``drain_s`` more; whatever is unfinished then is reported as unfinished, never dropped from the
  denominators: ``completed_fraction`` counts it, and the P50/P90 latencies count it as infinite
  (so they read ``inf`` once more than 50%/10% of the measured requests did not finish).
* A request no replica of its model could ever hold (its ``in + out`` exceeds the KV capacity),
  or of a model without replicas, is rejected at arrival and counted as not completed.

Theory of operation. Each replica is a vLLM-like engine: FIFO waiting queue; an iteration decodes
one token for every running request, continues chunked prefills, then admits waiting requests
in order while their ``in + out`` KV reservation fits and the iteration's token budget
(``max_batched_tokens``) and ``max_num_seqs`` allow, prefilling as much of each prompt as the
budget leaves (chunked prefill). A prompt's last chunk yields the first token (TTFT); each later
iteration yields one more. The iteration's duration is the roofline ``StepModel.time`` of its
aggregates (tokens, logit rows, KV tokens read, causal attention pairs). Running requests are
never preempted (reservations guarantee it). To keep an iteration O(1) in the batch size, a
replica keeps only the decode count, the sum of their contexts and, per future iteration
number, the requests that finish then.

Routing picks, at arrival, among the model's replicas whose KV can hold the request:
``least-loaded`` (default) minimises (outstanding + 1) / capacity, the capacity being the
analytic maximum rate of the replica type for the mean lengths of the model's requests;
``random`` draws in proportion to capacity; ``round-robin`` cycles.

``simulate`` draws the requests from workloads; ``simulate_requests`` replays a given list (a
trace) under the same rules.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from scheduler.analytic import max_rate
from scheduler.catalog import Catalog
from scheduler.errors import WorkloadError
from scheduler.placement import Placement
from scheduler.replica import ReplicaPerf, ServingConfig
from scheduler.roofline import RooflineConfig
from scheduler.workload import LengthStats, Workload, sample_length

ROUTERS = ("least-loaded", "random", "round-robin")
INF = math.inf


@dataclass(frozen=True)
class SimConfig:
    duration_s: float = 60.0
    warmup_s: float = 10.0
    drain_s: float = 60.0
    seed: int = 0
    routing: str = "least-loaded"

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError("need 0 <= warmup_s < duration_s")
        if self.drain_s < 0:
            raise ValueError("drain_s must not be negative")
        if self.routing not in ROUTERS:
            raise ValueError(f"routing must be one of {', '.join(ROUTERS)}")


@dataclass(frozen=True)
class Request:
    """One request of a trace: arrival time (s), catalog model id, prompt and output tokens."""

    arrival_s: float
    model: str
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class ModelResult:
    """Measured requests of one model (or of all, for ``SimResult.total``)."""

    model: str
    arrived: int
    completed: int
    rejected: int
    completed_fraction: float
    throughput_rps: float  # completions per second inside the measurement window
    output_tokens_per_s: float
    e2e_mean_s: float  # over completed requests (read with completed_fraction)
    e2e_p50_s: float  # unfinished requests count as infinite
    e2e_p90_s: float
    ttft_mean_s: float
    ttft_p90_s: float
    # over the requests that finished inside the window, whenever they arrived: under overload
    # (where few measured arrivals finish) the latency of what was served, queueing included
    served_e2e_mean_s: float = math.nan


@dataclass(frozen=True)
class SimResult:
    models: tuple[ModelResult, ...]
    total: ModelResult
    steps: int  # engine iterations simulated
    end_s: float  # simulated time when the run stopped

    def model(self, name: str) -> ModelResult:
        for m in self.models:
            if m.model == name:
                return m
        raise KeyError(name)


class Engine:
    """One engine's continuous batching, by the rules of the module docstring: the iteration
    step the simulation runs on every replica (``bench/autoscale.py`` runs it too, with a
    lifecycle around it). Requests are indexes into the caller's ``req_in`` / ``req_out``
    lengths; ``waiting`` is the FIFO queue the router appends to (and counts in
    ``outstanding``). ``start`` takes an iteration's work and says how long it takes;
    ``finish`` applies it when that time has come."""

    __slots__ = (
        "buckets",
        "budget",
        "busy",
        "chunks",
        "kv_cap",
        "kv_used",
        "max_seqs",
        "n_dec",
        "outstanding",
        "prefilling",
        "step_no",
        "sum_ctx",
        "time",
        "waiting",
    )

    def __init__(self, perf: ReplicaPerf) -> None:
        self.time = perf.step.time
        self.kv_cap = perf.kv_capacity_tokens
        self.max_seqs = perf.serving.max_num_seqs
        self.budget = perf.serving.max_batched_tokens
        self.waiting: deque[int] = deque()
        self.prefilling: list[list[int]] = []  # [request, tokens prefilled]
        self.chunks: list[tuple[list[int], int]] = []
        self.buckets: dict[int, list[int]] = {}  # iteration number -> requests ending then
        self.n_dec = 0
        self.sum_ctx = 0
        self.kv_used = 0
        self.step_no = 0
        self.outstanding = 0
        self.busy = False

    def start(self, req_in: Sequence[int], req_out: Sequence[int]) -> float | None:
        """Take the next iteration's work (decodes, prefill chunks, admissions): its duration
        in seconds, or None when there is nothing to do (the engine is idle until a request
        is routed to it)."""
        s = self.n_dec
        room = self.budget - s
        slots = self.max_seqs - s - len(self.prefilling)
        tokens = logits = s
        kv = pairs = self.sum_ctx + s
        chunks: list[tuple[list[int], int]] = []
        for entry in self.prefilling:
            if room <= 0:
                break
            rid, prefilled = entry
            q = min(req_in[rid] - prefilled, room)
            chunks.append((entry, q))
            room -= q
            tokens += q
            kv += prefilled + q
            pairs += q * prefilled + q * (q + 1) // 2
            if prefilled + q == req_in[rid]:
                logits += 1
        waiting = self.waiting
        while waiting and room > 0 and slots > 0:
            rid = waiting[0]
            need = req_in[rid] + req_out[rid]
            if self.kv_used + need > self.kv_cap:
                break
            waiting.popleft()
            self.kv_used += need
            slots -= 1
            entry = [rid, 0]
            self.prefilling.append(entry)
            q = min(req_in[rid], room)
            chunks.append((entry, q))
            room -= q
            tokens += q
            kv += q
            pairs += q * (q + 1) // 2
            if q == req_in[rid]:
                logits += 1
        if tokens == 0:
            self.busy = False
            return None
        self.busy = True
        self.chunks = chunks
        return self.time(tokens, logits, kv, pairs)

    def finish(
        self,
        req_in: Sequence[int],
        req_out: Sequence[int],
        first_token: Callable[[int], None],
        completed: Callable[[int], None],
    ) -> None:
        """Apply the iteration ``start`` took: one token for every decode, the prefill chunks.
        ``first_token(request)`` is called when a prompt's last chunk is done, then
        ``completed(request)`` for every request that ended in this iteration."""
        s = self.n_dec
        if s:
            self.step_no += 1
            self.sum_ctx += s
            ended = self.buckets.pop(self.step_no, None)
            if ended:
                for rid in ended:
                    completed(rid)
                    length = req_in[rid] + req_out[rid]
                    self.sum_ctx -= length - 1
                    self.kv_used -= length
                self.n_dec -= len(ended)
                self.outstanding -= len(ended)
        completed_prefill = False
        for entry, q in self.chunks:
            entry[1] += q
            rid = entry[0]
            if entry[1] == req_in[rid]:
                completed_prefill = True
                first_token(rid)
                out = req_out[rid]
                if out == 1:
                    completed(rid)
                    self.kv_used -= req_in[rid] + 1
                    self.outstanding -= 1
                else:
                    self.n_dec += 1
                    self.sum_ctx += req_in[rid]
                    key = self.step_no + out - 1
                    bucket = self.buckets.get(key)
                    if bucket is None:
                        self.buckets[key] = [rid]
                    else:
                        bucket.append(rid)
        if completed_prefill:
            self.prefilling = [e for e in self.prefilling if e[1] < req_in[e[0]]]
        self.chunks = []


class _Replica(Engine):
    __slots__ = ("index", "model", "weight")

    def __init__(self, perf: ReplicaPerf, index: int, model: int, weight: float) -> None:
        super().__init__(perf)
        self.index = index
        self.model = model
        self.weight = weight


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def generate_requests(
    workloads: Iterable[Workload], catalog: Catalog, duration_s: float, seed: int = 0
) -> list[Request]:
    """Poisson arrivals in ``[0, duration_s)`` for each workload, sorted by arrival. Each model
    draws from its own stream seeded by ``(seed, model)``."""
    requests: list[Request] = []
    for w in workloads:
        model = catalog.model(w.model)
        if w.rate_rps <= 0:
            continue
        rng = random.Random(f"{seed}/{model.name}")
        cap = model.max_context - 1
        t = 0.0
        while True:
            t += rng.expovariate(w.rate_rps)
            if t >= duration_s:
                break
            inp = sample_length(rng, w.input_mean, w.input_std, cap)
            out = sample_length(rng, w.output_mean, w.output_std, cap)
            requests.append(Request(t, model.name, inp, out))
    requests.sort(key=lambda r: (r.arrival_s, r.model))
    return requests


def simulate(
    placement: Placement,
    workloads: Iterable[Workload],
    catalog: Catalog,
    config: SimConfig | None = None,
    roofline: RooflineConfig | None = None,
    serving: ServingConfig | None = None,
) -> SimResult:
    """Run the workloads against the placement; see the module docstring for the rules."""
    cfg = config or SimConfig()
    loads = list(workloads)
    names = [catalog.model(w.model).name for w in loads]
    if len(set(names)) != len(names):
        raise WorkloadError("each model may have only one workload")
    requests = generate_requests(loads, catalog, cfg.duration_s, cfg.seed)
    return simulate_requests(placement, requests, catalog, cfg, roofline, serving, names)


def simulate_requests(
    placement: Placement,
    requests: Sequence[Request],
    catalog: Catalog,
    config: SimConfig | None = None,
    roofline: RooflineConfig | None = None,
    serving: ServingConfig | None = None,
    models: Sequence[str] = (),
) -> SimResult:
    """Replay ``requests`` (a trace; arrivals at or after ``duration_s`` are ignored) against
    the placement. Results are reported for ``models`` plus every model that has requests."""
    cfg = config or SimConfig()
    names: list[str] = [catalog.model(m).name for m in models]
    resolved: dict[str, str] = {}
    for req in requests:
        if req.model not in resolved:
            resolved[req.model] = name = catalog.model(req.model).name
            if name not in names:
                names.append(name)
    index = {name: i for i, name in enumerate(names)}
    trace = sorted(
        (r.arrival_s, index[resolved[r.model]], r.input_tokens, r.output_tokens)
        for r in requests
        if 0 <= r.arrival_s < cfg.duration_s
    )
    for _, m, inp, out in trace:
        if inp < 1 or out < 1:
            raise WorkloadError(f"{names[m]}: request lengths must be >= 1, got {inp}, {out}")

    # replicas, grouped by model; the router weighs them by analytic capacity for the trace's
    # mean lengths
    lengths = []
    for m in range(len(names)):
        ins = [t[2] for t in trace if t[1] == m] or [1]
        outs = [t[3] for t in trace if t[1] == m] or [1]
        lengths.append(
            LengthStats(
                sum(ins) / len(ins),
                sum(i * i for i in ins) / len(ins),
                sum(outs) / len(outs),
                sum(o * o for o in outs) / len(outs),
            )
        )
    replicas: list[_Replica] = []
    by_model: list[list[_Replica]] = [[] for _ in names]
    for alloc in placement.allocations:
        model = catalog.model(alloc.model)
        if model.name not in index:
            continue  # GPUs given to a model without traffic simply idle
        m = index[model.name]
        perf = ReplicaPerf(model, catalog.gpu(alloc.gpu), alloc.tp, roofline, serving)
        weight = max_rate(perf, lengths[m]) or 1e-9
        for _ in range(alloc.dp):
            r = _Replica(perf, len(replicas), m, weight)
            replicas.append(r)
            by_model[m].append(r)

    n_req = len(trace)
    arr_t = [a[0] for a in trace]
    req_model = [a[1] for a in trace]
    req_in = [a[2] for a in trace]
    req_out = [a[3] for a in trace]
    first = [INF] * n_req
    done = [INF] * n_req
    rejected = [False] * n_req

    route_rng = random.Random(f"{cfg.seed}/routing")
    rr_next = [0] * len(names)
    routing = cfg.routing
    heap: list[tuple[float, int, int]] = []
    counter = 0
    steps = 0
    end = cfg.duration_s + cfg.drain_s
    now = 0.0

    def first_token(rid: int) -> None:
        first[rid] = now

    def completed(rid: int) -> None:
        done[rid] = now

    def start(r: _Replica, now: float) -> None:
        nonlocal counter, steps
        duration = r.start(req_in, req_out)
        if duration is None:
            return
        counter += 1
        steps += 1
        heapq.heappush(heap, (now + duration, counter, r.index))

    i = 0
    while True:
        next_arrival = arr_t[i] if i < n_req else INF
        if heap and heap[0][0] <= next_arrival:
            now = heap[0][0]
            if now > end:
                break
            _, _, ri = heapq.heappop(heap)
            r = replicas[ri]
            r.finish(req_in, req_out, first_token, completed)
            start(r, now)
            continue
        if i >= n_req:
            break
        now = next_arrival
        rid = i
        i += 1
        need = req_in[rid] + req_out[rid]
        candidates = [r for r in by_model[req_model[rid]] if r.kv_cap >= need]
        if not candidates:
            rejected[rid] = True
            continue
        if routing == "least-loaded":
            best = candidates[0]
            best_score = (best.outstanding + 1) / best.weight
            for r in candidates[1:]:
                score = (r.outstanding + 1) / r.weight
                if score < best_score:
                    best, best_score = r, score
        elif routing == "random":
            best = route_rng.choices(candidates, [r.weight for r in candidates])[0]
        else:
            m = req_model[rid]
            best = candidates[rr_next[m] % len(candidates)]
            rr_next[m] += 1
        best.waiting.append(rid)
        best.outstanding += 1
        if not best.busy:
            start(best, now)

    # -- measurement ------------------------------------------------------------------------
    window = cfg.duration_s - cfg.warmup_s
    lo, hi = cfg.warmup_s, cfg.duration_s

    def summarise(name: str, ids: list[int], finished_in_window: list[int]) -> ModelResult:
        arrived = len(ids)
        completed = [rid for rid in ids if done[rid] < INF]
        e2e = sorted(done[rid] - arr_t[rid] for rid in ids)
        ttft = sorted(first[rid] - arr_t[rid] for rid in ids)
        e2e_done = [done[rid] - arr_t[rid] for rid in completed]
        ttft_done = [first[rid] - arr_t[rid] for rid in ids if first[rid] < INF]
        return ModelResult(
            model=name,
            arrived=arrived,
            completed=len(completed),
            rejected=sum(1 for rid in ids if rejected[rid]),
            completed_fraction=len(completed) / arrived if arrived else 1.0,
            throughput_rps=len(finished_in_window) / window,
            output_tokens_per_s=sum(req_out[rid] for rid in finished_in_window) / window,
            e2e_mean_s=sum(e2e_done) / len(e2e_done) if e2e_done else math.nan,
            e2e_p50_s=_percentile(e2e, 0.5),
            e2e_p90_s=_percentile(e2e, 0.9),
            ttft_mean_s=sum(ttft_done) / len(ttft_done) if ttft_done else math.nan,
            ttft_p90_s=_percentile(ttft, 0.9),
            served_e2e_mean_s=(
                sum(done[rid] - arr_t[rid] for rid in finished_in_window) / len(finished_in_window)
                if finished_in_window
                else math.nan
            ),
        )

    measured: list[list[int]] = [[] for _ in names]
    finished: list[list[int]] = [[] for _ in names]
    for rid in range(n_req):
        m = req_model[rid]
        if lo <= arr_t[rid]:
            measured[m].append(rid)
        if lo <= done[rid] < hi:
            finished[m].append(rid)
    results = tuple(summarise(names[m], measured[m], finished[m]) for m in range(len(names)))
    total = summarise(
        "total",
        [rid for ids in measured for rid in ids],
        [rid for ids in finished for rid in ids],
    )
    return SimResult(results, total, steps, min(now, end))
