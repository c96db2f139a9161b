"""Analytic steady state of continuous batching on one replica, and the solver's tables.

Theory of operation (docs/scheduler.md, "Analytic model"). A replica runs iterations back to back
while it has work. Each iteration decodes one token for every running request and prefills the
requests that arrived during the previous iteration (chunked at ``max_batched_tokens``).
Parametrise the steady state by ``kappa``, the mean number of arrivals per iteration:

* a decoding request shares its iterations with ``B = 1 + D * kappa`` decoding requests, where
  ``D = E[out] - 1`` decode iterations per request (Little's law: ``lambda * D * tau`` others);
* an iteration carries ``K ~ Poisson(kappa)`` prompts; its roofline time with ``B`` decodes at
  the workload's mean decode context and ``K`` mean prompts gives the mean iteration time
  ``tau`` (and its second moment) as a Poisson mixture, chunked prompts adding iterations;
* the arrival rate that produces ``kappa`` is then ``lambda = kappa / tau``: no fixed point to
  solve, so a whole latency-vs-rate table costs a few hundred roofline evaluations;
* KV capacity: a request reserves ``in + out`` tokens from admission to its last token (``R`` =
  its prefill iteration plus ``D * tau``), so the replica is an M/M/c queue with ``c`` = KV
  capacity over the mean reservation (at most ``max_num_seqs``) and offered load ``lambda * R``;
  Erlang C gives the admission wait and ``lambda * R < c`` the stability limit.

Latency: ``TTFT = wait + residual of the iteration in progress (if busy) + the iteration that
carries the request's prompt (with the Poisson number of others)``, ``E2E = TTFT + D * tau``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler.catalog import Catalog
from scheduler.placement import Placement
from scheduler.replica import ReplicaPerf, ServingConfig, tp_options
from scheduler.roofline import RooflineConfig
from scheduler.workload import LengthStats, Workload

INF = math.inf


@dataclass(frozen=True)
class SteadyState:
    """One replica at one arrival rate. Times in seconds; ``stable`` False means the queue grows
    without bound (then latencies are ``inf`` and ``limit`` says which resource ran out)."""

    rate_rps: float
    stable: bool
    limit: str  # "" when stable, else "kv" (KV capacity or sequence slots) or "budget"
    batch: float  # decoding requests per iteration, as a decoding request sees it
    step_s: float  # mean iteration time = mean time per output token after the first
    queue_s: float  # waiting for KV space before admission
    ttft_s: float
    e2e_s: float
    in_engine: float  # mean admitted requests (holding KV)
    busy: float  # fraction of time the replica is iterating
    slots: float  # requests the KV cache holds at once


def _erlang_c(servers: int, load: float) -> float:
    """Probability that an arrival waits in M/M/c with ``servers`` and offered ``load``."""
    if load <= 0:
        return 0.0
    if load >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return servers * b / (servers - load * (1.0 - b))


POISSON_EXACT_MAX = 400.0  # above this many arrivals per cycle: a point mass at the mean


class _Model:
    """The explicit map kappa -> steady state for one replica and workload."""

    def __init__(self, perf: ReplicaPerf, lengths: LengthStats) -> None:
        self.perf = perf
        self.lengths = lengths
        self.time = perf.step.time
        self.budget = perf.serving.max_batched_tokens
        self.slots = perf.slots(lengths)
        self.servers = math.floor(self.slots)

    def _iteration(self, batch: float, k: int) -> tuple[float, int]:
        """Total time and number of iterations that prefill ``k`` mean prompts alongside
        ``batch`` decodes."""
        ls = self.lengths
        decode_kv = batch * (ls.decode_context + 1.0)
        if k == 0:
            return self.time(batch, batch, decode_kv, decode_kv), 1
        prompt_tokens = k * ls.input_mean
        room = self.budget - batch
        if room < 1:
            return INF, 1
        n = max(1, math.ceil(prompt_tokens / room))
        chunk = prompt_tokens / n
        per_step = self.time(
            batch + chunk,
            batch + k / n,
            decode_kv + prompt_tokens * (n + 1) / (2 * n),
            decode_kv + k * ls.prefill_pairs / n,
        )
        return n * per_step, n

    def _poisson(self, batch: float, mean: float) -> tuple[float, float, float, float]:
        """Over K ~ Poisson(mean) prompts in an iteration with ``batch`` decodes: E[time],
        E[iterations], E[sum of squared iteration times], and E[time] with one more prompt."""
        if mean > POISSON_EXACT_MAX:
            # exp(-mean) underflows; the Poisson is then tight around its mean (CV < 5%).
            k = round(mean)
            t, n = self._iteration(batch, k)
            return t, n, t * t / n, self._iteration(batch, k + 1)[0]
        p = math.exp(-mean)
        cumulative = total_time = total_steps = second = plus_one = 0.0
        k = 0
        prev = self._iteration(batch, 0)
        while True:
            nxt = self._iteration(batch, k + 1)
            t, n = prev
            total_time += p * t
            total_steps += p * n
            second += p * t * t / n
            plus_one += p * nxt[0]
            cumulative += p
            k += 1
            if cumulative > 1.0 - 1e-9 or k > mean + 12.0 * math.sqrt(mean) + 12:
                break
            p *= mean / k
            prev = nxt
        return (
            total_time / cumulative,
            total_steps / cumulative,
            second / cumulative,
            plus_one / cumulative,
        )

    def point(self, kappa: float) -> SteadyState:
        """The steady state with ``kappa`` arrivals per admission cycle (one iteration, or the
        iterations a chunked prefill spans)."""
        ls = self.lengths
        decode_steps = max(ls.decode_steps, 0.0)
        # Little: decoding requests = rate * D * tau = D * kappa / E[iterations per cycle].
        others = decode_steps * kappa
        for _ in range(8):
            time, steps, second, _ = self._poisson(1.0 + others, kappa)
            settled = decode_steps * kappa / steps
            if abs(settled - others) <= 1e-6 * (1.0 + others):
                break
            others = settled
        batch = 1.0 + others  # a decoding request shares its iterations with the others
        rate = kappa / time if time > 0 else 0.0
        tau = time / steps
        if not math.isfinite(tau):
            return self._unstable(rate, batch, tau, "budget")
        tau_sq = second / steps
        # The iteration carrying a new prompt: alone if the replica was idle; if busy, with the
        # others that arrived during the (length-biased) iteration in progress.
        was_busy = 1.0 - math.exp(-rate * (tau + decode_steps * tau))
        _, _, _, own_busy = self._poisson(others, rate * tau_sq / tau)
        own_idle = self._iteration(others, 1)[0]
        own = was_busy * own_busy + (1.0 - was_busy) * own_idle
        if not math.isfinite(own):
            return self._unstable(rate, batch, tau, "budget")
        hold = own + decode_steps * tau
        load = rate * hold
        if self.servers < 1 or load >= self.servers:
            return self._unstable(rate, batch, tau, "kv")
        queue = _erlang_c(self.servers, load) * hold / (self.servers - load)
        busy = 1.0 - math.exp(-load)
        residual = busy * tau_sq / (2.0 * tau)
        ttft = queue + residual + own
        return SteadyState(
            rate_rps=rate,
            stable=True,
            limit="",
            batch=batch,
            step_s=tau,
            queue_s=queue,
            ttft_s=ttft,
            e2e_s=ttft + decode_steps * tau,
            in_engine=load,
            busy=busy,
            slots=self.slots,
        )

    def _unstable(self, rate: float, batch: float, tau: float, limit: str) -> SteadyState:
        return SteadyState(
            rate_rps=rate,
            stable=False,
            limit=limit,
            batch=batch,
            step_s=tau,
            queue_s=INF,
            ttft_s=INF,
            e2e_s=INF,
            in_engine=self.slots,
            busy=1.0,
            slots=self.slots,
        )

    def kappa_limit(self) -> float:
        """The largest stable kappa (to a relative 1e-6), 0 if even one request never fits."""
        if not self.point(0.0).stable:
            return 0.0
        lo, hi = 0.0, 0.25
        while self.point(hi).stable:
            lo, hi = hi, hi * 2
            if hi > 1e7:
                return lo
        while hi - lo > 1e-6 * hi:
            mid = (lo + hi) / 2
            if self.point(mid).stable:
                lo = mid
            else:
                hi = mid
        return lo


def steady_state(perf: ReplicaPerf, lengths: LengthStats, rate_rps: float) -> SteadyState:
    """The replica's steady state at ``rate_rps`` arrivals per second."""
    model = _Model(perf, lengths)
    if rate_rps <= 0:
        return model.point(0.0)
    k_max = model.kappa_limit()
    top = model.point(k_max)
    if k_max <= 0 or rate_rps >= top.rate_rps:
        beyond = model.point(k_max * (1 + 1e-5) + 1e-9)
        return model._unstable(rate_rps, beyond.batch, beyond.step_s, beyond.limit or "kv")
    lo, hi = 0.0, k_max
    for _ in range(60):
        mid = (lo + hi) / 2
        if model.point(mid).rate_rps < rate_rps:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * k_max:
            break
    return model.point(hi)


def max_rate(perf: ReplicaPerf, lengths: LengthStats) -> float:
    """The highest sustainable arrival rate (req/s) of the replica for this workload."""
    model = _Model(perf, lengths)
    k_max = model.kappa_limit()
    return model.point(k_max).rate_rps if k_max > 0 else 0.0


@dataclass(frozen=True)
class ReplicaTable:
    """Latency as a function of a replica's arrival rate, for a solver to linearise.

    ``points`` run from zero load to just below ``max_rate_rps``, rates increasing."""

    name: str
    max_rate_rps: float
    points: tuple[SteadyState, ...]

    def _interpolate(self, rate: float, attr: str) -> float:
        if rate >= self.max_rate_rps or not self.points:
            return INF
        rates = [p.rate_rps for p in self.points]
        i = bisect.bisect_right(rates, rate)
        if i >= len(rates):
            return INF
        if i == 0:
            return float(getattr(self.points[0], attr))
        a, b = self.points[i - 1], self.points[i]
        w = (rate - a.rate_rps) / (b.rate_rps - a.rate_rps)
        return float(getattr(a, attr)) * (1 - w) + float(getattr(b, attr)) * w

    def e2e_s(self, rate_rps: float) -> float:
        """Mean end-to-end latency at ``rate_rps`` (``inf`` at or beyond capacity)."""
        return self._interpolate(rate_rps, "e2e_s")

    def ttft_s(self, rate_rps: float) -> float:
        return self._interpolate(rate_rps, "ttft_s")


def replica_table(perf: ReplicaPerf, lengths: LengthStats, points: int = 40) -> ReplicaTable:
    """``points`` steady states from idle to 99.9% of the replica's capacity."""
    model = _Model(perf, lengths)
    k_max = model.kappa_limit()
    if k_max <= 0:
        return ReplicaTable(perf.name, 0.0, ())
    # denser towards saturation, where latency bends upward
    fractions = [1.0 - (1.0 - i / (points - 1)) ** 2 for i in range(points)]
    states = [model.point(k_max * f * 0.999) for f in fractions]
    top = model.point(k_max)
    return ReplicaTable(perf.name, top.rate_rps, tuple(s for s in states if s.stable))


# -- several replicas of one model --------------------------------------------------------------


@dataclass(frozen=True)
class ModelEstimate:
    """Analytic prediction for one model served by a set of replicas."""

    model: str
    rate_rps: float
    capacity_rps: float
    throughput_rps: float  # min(rate, capacity)
    stable: bool
    e2e_s: float  # rate-weighted mean over replicas (inf when unstable)
    ttft_s: float


def estimate_model(
    model: str, rate_rps: float, replicas: Sequence[tuple[ReplicaTable, int]]
) -> ModelEstimate:
    """Split ``rate_rps`` over ``count`` replicas of each table in proportion to capacity (what
    a load-aware router converges to under load) and combine their latencies."""
    capacity = sum(t.max_rate_rps * n for t, n in replicas)
    if rate_rps <= 0:
        return ModelEstimate(model, 0.0, capacity, 0.0, True, 0.0, 0.0)
    if rate_rps >= capacity:
        return ModelEstimate(model, rate_rps, capacity, capacity, False, INF, INF)
    share = rate_rps / capacity
    e2e = ttft = 0.0
    for table, count in replicas:
        r = table.max_rate_rps * share
        weight = r * count / rate_rps
        e2e += weight * table.e2e_s(r)
        ttft += weight * table.ttft_s(r)
    stable = math.isfinite(e2e)
    return ModelEstimate(model, rate_rps, capacity, rate_rps, stable, e2e, ttft)


# -- tables for a solver, and a placement's prediction -----------------------------------------

TableKey = tuple[str, str, int]  # (model, GPU type, tp), catalog names


def replica_tables(
    catalog: Catalog,
    workloads: Iterable[Workload],
    gpu_types: Iterable[str],
    roofline: RooflineConfig | None = None,
    serving: ServingConfig | None = None,
    points: int = 40,
) -> dict[TableKey, ReplicaTable]:
    """A table for every memory-feasible (model, GPU type, tp) of these workloads and GPUs
    (C2 and the TP rules of C3 applied: infeasible combinations are absent)."""
    gpus = [catalog.gpu(g) for g in gpu_types]
    tables: dict[TableKey, ReplicaTable] = {}
    for w in workloads:
        model = catalog.model(w.model)
        lengths = w.lengths(model.max_context)
        for gpu in gpus:
            for tp in tp_options(model, gpu, lengths, roofline, serving):
                perf = ReplicaPerf(model, gpu, tp, roofline, serving)
                tables[(model.name, gpu.name, tp)] = replica_table(perf, lengths, points)
    return tables


@dataclass(frozen=True)
class PlacementEstimate:
    """Analytic prediction for a placement: per model, and rate-weighted totals."""

    models: tuple[ModelEstimate, ...]
    throughput_rps: float  # sum of min(rate, capacity)
    e2e_s: float  # rate-weighted mean over models; inf if any model is unstable
    stable: bool


def estimate_placement(
    placement: Placement,
    workloads: Iterable[Workload],
    catalog: Catalog,
    roofline: RooflineConfig | None = None,
    serving: ServingConfig | None = None,
    tables: dict[TableKey, ReplicaTable] | None = None,
) -> PlacementEstimate:
    """Predict a placement with the analytic model (``tables`` are reused and filled in)."""
    cache = {} if tables is None else tables
    estimates: list[ModelEstimate] = []
    for w in workloads:
        model = catalog.model(w.model)
        lengths = w.lengths(model.max_context)
        groups: list[tuple[ReplicaTable, int]] = []
        for a in placement.allocations:
            if catalog.model(a.model).name != model.name or a.dp <= 0:
                continue
            gpu = catalog.gpu(a.gpu)
            key = (model.name, gpu.name, a.tp)
            table = cache.get(key)
            if table is None:
                perf = ReplicaPerf(model, gpu, a.tp, roofline, serving)
                table = replica_table(perf, lengths)
                cache[key] = table
            groups.append((table, a.dp))
        estimates.append(estimate_model(model.name, w.rate_rps, groups))
    rate = sum(e.rate_rps for e in estimates)
    stable = all(e.stable for e in estimates)
    e2e = sum(e.e2e_s * e.rate_rps for e in estimates) / rate if stable and rate > 0 else INF
    if stable and rate <= 0:
        e2e = 0.0
    return PlacementEstimate(
        tuple(estimates), sum(e.throughput_rps for e in estimates), e2e, stable
    )
