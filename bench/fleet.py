"""Fleet economics: many models on one GPU budget, most of them idle most of the time.

CPU only, one process, deterministic for a seed (a discrete-event simulation: no wall clock;
about two minutes of CPU for the default day). A shared cluster serves many models (the
LLMFabric deployment served 142), with heavy-tailed popularity. The bench builds such a fleet
from the Azure LLM conversation trace and replays one day of it under four policies:

  always-on     one replica per model, serving the whole day (what a static deployment of
                every model costs)
  ours          the elastic controller's rules per model: scale from zero on the first request
                (held while the replica starts), ``ForecastPolicy`` above one replica, the
                engines sleep after ``--sleep-after`` (60 s) without a request and wake for
                the next, the model returns to zero after ``--idle-to-zero`` without one (600
                s, the service file's default)
  ours-nosleep  the same without sleep
  what-if       context, not built: as ``ours``, but a sleeping engine's GPUs are not billed
                (what co-locating sleeping engines, or a node-level pool of them, could save
                at most), with a longer ``--what-if-idle-to-zero``

Trace: shared/data/azure-llm-2023-conv.csv beside the checkout (``--trace``), a copy of
Azure/AzurePublicDataset's AzureLLMInferenceTrace_conv.csv (one hour, 19,366 requests), CC-BY
4.0. Attribution, as its owners ask: Pratyush Patel, Esha Choukse, Chaojie Zhang, Aashaka Shah,
Íñigo Goiri, Saeed Maleki, Ricardo Bianchini. "Splitwise: Efficient generative LLM inference
using phase splitting", ISCA 2024. The day (``--day-hours``, 24) is ``bench/autoscale.py``'s
diurnal day: the hour repeated end to end, each request kept with the probability of a cosine
day (``--trough`` of the peak at 04:00, all at 16:00), then ``--share`` of its requests (10%:
~28,000 a day, about LLMFabric's mean of 13 million requests in 16 months). Each request goes
to one of ``--models`` models drawn from a Zipf law (``--zipf``, 1.5: P(rank k) ~ k^-s), with
its own prompt and output lengths; which model kind holds which rank is a seeded shuffle.

The models (``KINDS``, every one in the scheduler's catalog) run on A100-80G: 7-13B models on
one GPU, a 30B MoE and a 34B on two, 70B models on four. Per kind, from the roofline
(``scheduler.replica.ReplicaPerf``) and the measurements in docs/benchmarks.md:

* capacity: the planner's saturation rates (``planner_capacity``, the trace's lengths);
* cold start = ``--queue-wait`` (Slurm, an assumption: 30 s) + the engine's start-up, measured
  (vLLM from process start to first token, bench/sleepwake.py: 19.4 s) + the weights read from
  shared storage at ``--storage-gbs`` (2 GB/s per job, an assumption);
* wake-up = the weights per GPU copied back from host memory at ``--h2d-gbs`` (25 GB/s, PCIe 4
  x16, an assumption: vLLM's GPU sleep level 1) + vLLM's /wake_up (0.10 s, measured) + the
  mesh's hop (0.05 s, measured).

A replica is modelled by its work, not by engine iterations (so a day of 40 models runs in
seconds): its prompts are prefilled first come first served at ``prefill_tokens_per_s``
scaled down by the share of the replica its model's decode demand takes (``decode_tokens_per_s``);
the first token follows the prompt's prefill; the output then streams at the roofline's decode
step. Requests go to the serving replica whose prefill frees first. The controller's pass runs
every 2 s per model with replicas: it asks the model's ``ForecastPolicy`` (arrivals, outputs,
queued prompts per replica, the p95 TTFT of the last minute) for a count within [1,
``--max-replicas``], applies the sleep and idle-to-zero rules, and submits within the GPU budget
(``--budget-gpus``, default the always-on fleet's GPUs): a submission over it waits, as a job
pends in Slurm, and its cold start begins when GPUs free. A request for a model with no serving
replica is held (``hold_requests``, 3 min: longer is a failure) and served when one is. GPUs
are billed from a job's start to its end, asleep or not: a sleeping vLLM engine frees GPU memory
but its Slurm job keeps the GPUs (docs/operators.md, "Warm capacity").

Reported per policy: GPU-hours (and against always-on), the share of requests within the TTFT
objective (``--objective``, 2 s; held-too-long and unfinished requests count as missed), the same
for the requests that found their model awake, and the first-token times of the requests that
found their model at zero (a cold start) or asleep (a wake-up) as a distribution; cold starts,
wake-ups, the fleet's mean and peak GPUs held; then ``ours`` again for each idle-to-zero time
of ``--idle-sweep`` (the knob that sets what scale-to-zero saves and what it costs: the
requests that find their model at zero). Target (issue 39): ours >= 60% fewer GPU-hours than
always-on with >= 99% of the requests to awake models within the objective.

    .venv/bin/python bench/fleet.py                        # the day, 40 models, four policies
    .venv/bin/python bench/fleet.py --zipf 1.0 --json out.json
    .venv/bin/python bench/fleet.py --quick                # one hour, 12 models (smoke test)
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from bisect import bisect_right
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fabricnode.elastic.capacity import planner_capacity
from fabricnode.elastic.policy import (
    ForecastPolicy,
    LoadSample,
    PolicyConfig,
    ReplicaCapacity,
    ReplicaState,
)
from scheduler.catalog import builtin_catalog
from scheduler.replica import ReplicaPerf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autoscale import ATTRIBUTION, TRACE, Trace, diurnal_trace, load_trace, percentile

INF = math.inf
GPU = "A100-80G"
# (catalog model, GPUs per replica): the fleet's kinds, drawn in these proportions
KINDS: tuple[tuple[str, int], ...] = (
    ("llama-3.1-8b", 1),
    ("qwen2.5-7b", 1),
    ("llama-2-7b", 1),
    ("llama-2-13b", 1),
    ("qwen3-30b-a3b", 2),
    ("codellama-34b", 2),
    ("llama-3.3-70b", 4),
    ("qwen2.5-72b", 4),
)
ENGINE_START_S = 19.4  # vLLM, process start to first token (bench/sleepwake.py, measured)
WAKE_CALL_S = 0.10  # vLLM's /wake_up itself (bench/sleepwake.py, measured on CPU)
MESH_HOP_S = 0.05  # the mesh's hop to a sleeping node (bench/sleepwake.py: 0.03-0.06 s)
PASS_S = 2.0  # the controller's pass: the sleep and idle rules
POLICY_S = 10.0  # the policy is asked once per forecast bin (its demand changes no faster)
HOLD_REQUESTS_S = 180.0  # the ingress holds a request this long for a starting replica
TTFT_WINDOW_S = 60.0  # the controller's p95 TTFT window, with at least 20 first tokens
TTFT_MIN_SAMPLES = 20
POLICIES = ("always-on", "ours", "ours-nosleep", "what-if")
SAVING_TARGET = 0.60
AWAKE_TARGET = 0.99


@dataclass(frozen=True)
class Kind:
    """One model kind on its GPUs: what the roofline and the measurements give."""

    model: str
    gpus: int
    capacity: ReplicaCapacity
    cold_start_s: float
    wake_s: float
    decode_step_s: float  # one decode step of a small batch: the output's pace


def make_kind(model: str, gpus: int, trace: Trace, args: argparse.Namespace) -> Kind:
    catalog = builtin_catalog()
    perf = ReplicaPerf(catalog.model(model), catalog.gpu(GPU), gpus)
    lengths = trace.lengths()
    weights_per_gpu = perf.memory.weight_bytes_per_gpu
    return Kind(
        model=model,
        gpus=gpus,
        capacity=planner_capacity(perf, lengths),
        cold_start_s=args.queue_wait
        + ENGINE_START_S
        + weights_per_gpu * gpus / (args.storage_gbs * 1e9),
        wake_s=weights_per_gpu / (args.h2d_gbs * 1e9) + WAKE_CALL_S + MESH_HOP_S,
        decode_step_s=perf.step.decode_time(8, lengths.input_mean + lengths.output_mean / 2),
    )


def thin(trace: Trace, share: float, seed: int) -> Trace:
    """Each request kept with probability ``share`` (a seeded draw)."""
    if share >= 1.0:
        return trace
    rng = random.Random(seed + 1)
    keep = [k for k in range(len(trace)) if rng.random() < share]
    return Trace(
        tuple(trace.arrival_s[k] for k in keep),
        tuple(trace.prompt[k] for k in keep),
        tuple(trace.output[k] for k in keep),
    )


@dataclass(frozen=True)
class Fleet:
    """The models (rank 0 the most popular) and each request's model."""

    kinds: tuple[Kind, ...]  # per model
    model_of: tuple[int, ...]  # per request


def make_fleet(trace: Trace, args: argparse.Namespace) -> Fleet:
    rng = random.Random(args.seed)
    n = args.models
    kinds_by_name = {m: make_kind(m, g, trace, args) for m, g in KINDS}
    per_model = [KINDS[k % len(KINDS)] for k in range(n)]
    rng.shuffle(per_model)
    weights = [(k + 1) ** -args.zipf for k in range(n)]
    total = sum(weights)
    cumulative = []
    acc = 0.0
    for w in weights:
        acc += w / total
        cumulative.append(acc)
    model_of = tuple(min(n - 1, bisect_right(cumulative, rng.random())) for _ in trace.arrival_s)
    return Fleet(tuple(kinds_by_name[m] for m, _ in per_model), model_of)


# -- the simulation ------------------------------------------------------------------------------

STARTING, SERVING, ASLEEP, WAKING, GONE = range(5)
AWAKE_FOUND, ASLEEP_FOUND, ZERO_FOUND = "awake", "asleep", "zero"


@dataclass(frozen=True)
class Rules:
    """A policy of the fleet (module docstring)."""

    name: str
    dynamic: bool  # False: one replica per model, all day
    sleep_after_s: float = INF
    idle_to_zero_s: float = INF
    sleep_billed: bool = True
    max_replicas: int = 8


class Rep:
    __slots__ = ("free_at", "gpus", "index", "queued", "ready_at", "since", "state")

    def __init__(self, index: int, gpus: int, since: float, ready_at: float) -> None:
        self.index = index
        self.gpus = gpus
        self.since = since  # billed from here (the job's start)
        self.ready_at = ready_at
        self.state = STARTING if ready_at > since else SERVING
        self.free_at = 0.0  # when its prefill queue empties
        self.queued: deque[float] = deque()  # prefill start times of its requests, in order


@dataclass
class ModelRun:
    kind: Kind
    reps: list[Rep] = field(default_factory=list)
    pending: deque[int] = field(default_factory=deque)  # held requests (no replica serving)
    last_busy: float = -INF  # the last arrival or end of a request
    decode_rate: float = 0.0  # decode tokens/s, smoothed over a minute
    decode_seen: float = -INF
    ttfts: deque[tuple[float, float]] = field(default_factory=deque)
    policy: ForecastPolicy | None = None
    waiting_jobs: int = 0  # submissions waiting for GPUs

    def held(self) -> list[Rep]:
        return [r for r in self.reps if r.state != GONE]


@dataclass
class Outcome:
    """What one policy did to the day."""

    policy: str
    ttft_s: list[float]
    found: list[str]
    gpu_s: float
    gpu_s_asleep: float
    cold_starts: int
    wake_ups: int
    peak_gpus: int
    budget_waits: int
    wall_s: float


def simulate(trace: Trace, fleet: Fleet, rules: Rules, args: argparse.Namespace) -> Outcome:
    wall = time.monotonic()
    n = len(trace)
    arr, req_in, req_out = trace.arrival_s, trace.prompt, trace.output
    span = trace.span_s
    ttft = [INF] * n
    found = [""] * n
    objective = args.objective
    config = PolicyConfig(ttft_objective_s=objective)
    models = [ModelRun(k) for k in fleet.kinds]
    heap: list[tuple[float, int, int, int]] = []  # (time, seq, model, replica index): ready
    seq = 0
    gpus_held = 0
    peak = 0
    gpu_s = 0.0
    gpu_s_asleep = 0.0
    cold_starts = wake_ups = budget_waits = 0
    jobs_waiting: deque[int] = deque()  # models with a submission waiting for GPUs

    def bill(r: Rep, until: float) -> None:
        nonlocal gpu_s, gpu_s_asleep
        lo, hi = r.since, min(until, span)
        if hi > lo:
            if r.state == ASLEEP and not rules.sleep_billed:
                pass
            else:
                gpu_s += r.gpus * (hi - lo)
                if r.state == ASLEEP:
                    gpu_s_asleep += r.gpus * (hi - lo)
        r.since = max(r.since, until)

    def submit(m: int, now: float) -> None:
        """A new job for model m, or a wait for GPUs."""
        nonlocal seq, gpus_held, peak, cold_starts, budget_waits
        mr = models[m]
        k = mr.kind
        if gpus_held + k.gpus > args.budget_gpus:
            mr.waiting_jobs += 1
            jobs_waiting.append(m)
            budget_waits += 1
            return
        r = Rep(len(mr.reps), k.gpus, now, now + k.cold_start_s)
        mr.reps.append(r)
        gpus_held += k.gpus
        peak = max(peak, gpus_held)
        cold_starts += 1
        seq += 1
        heapq.heappush(heap, (r.ready_at, seq, m, r.index))

    def release(m: int, r: Rep, now: float) -> None:
        nonlocal gpus_held
        bill(r, now)
        if r.state != GONE:
            r.state = GONE
            gpus_held -= r.gpus
        while jobs_waiting and gpus_held + models[jobs_waiting[0]].kind.gpus <= args.budget_gpus:
            w = jobs_waiting.popleft()
            models[w].waiting_jobs -= 1
            submit(w, now)

    def serve(m: int, rid: int, now: float) -> None:
        """Route request rid to the serving replica whose prefill frees first."""
        mr = models[m]
        k = mr.kind
        best = min((r for r in mr.reps if r.state == SERVING), key=lambda r: r.free_at)
        awake = sum(1 for r in mr.reps if r.state == SERVING)
        share = min(0.8, mr.decode_rate / (k.capacity.decode_tokens_per_s * awake))
        start = max(now, best.free_at)
        prefill = req_in[rid] / (k.capacity.prefill_tokens_per_s * (1.0 - share))
        best.free_at = start + prefill
        best.queued.append(start)
        first = start + prefill
        ttft[rid] = first - arr[rid]
        mr.last_busy = max(mr.last_busy, first + req_out[rid] * k.decode_step_s)
        mr.ttfts.append((first, ttft[rid]))
        if mr.policy is not None:
            mr.policy.observe_completion(now, req_out[rid])

    def note_decode(mr: ModelRun, now: float, tokens: int) -> None:
        decay = math.exp(-(now - mr.decode_seen) / 60.0) if mr.decode_seen > -INF else 0.0
        mr.decode_rate = mr.decode_rate * decay + tokens / 60.0
        mr.decode_seen = now

    def wake(m: int, now: float) -> None:
        nonlocal seq, wake_ups
        mr = models[m]
        for r in mr.reps:
            if r.state == ASLEEP:
                bill(r, now)
                r.state = WAKING
                r.ready_at = now + mr.kind.wake_s
                wake_ups += 1
                seq += 1
                heapq.heappush(heap, (r.ready_at, seq, m, r.index))

    def ready(m: int, ri: int, now: float) -> None:
        mr = models[m]
        r = mr.reps[ri]
        if r.state not in (STARTING, WAKING) or r.ready_at != now:
            return
        bill(r, now)
        r.state = SERVING
        r.free_at = max(r.free_at, now)
        while mr.pending:
            rid = mr.pending.popleft()
            if now - arr[rid] > HOLD_REQUESTS_S:
                continue  # the ingress gave up on it (503): missed
            serve(m, rid, now)

    def tick(m: int, now: float, ask: bool) -> None:
        mr = models[m]
        held = mr.held()
        if not held:
            return
        # requests held too long are answered 503 by the ingress
        while mr.pending and now - arr[mr.pending[0]] > HOLD_REQUESTS_S:
            mr.pending.popleft()
        idle = now - mr.last_busy
        if idle >= rules.idle_to_zero_s and not mr.pending:
            for r in held:
                release(m, r, now)
            return
        if idle >= rules.sleep_after_s and not mr.pending:
            for r in held:
                if r.state == SERVING and r.free_at <= now:
                    bill(r, now)
                    r.state = ASLEEP
        serving = [r for r in held if r.state == SERVING]
        while mr.ttfts and mr.ttfts[0][0] < now - TTFT_WINDOW_S:
            mr.ttfts.popleft()
        policy = mr.policy
        if policy is None or not ask:
            return
        if len(mr.ttfts) >= TTFT_MIN_SAMPLES:
            values = sorted(v for _, v in mr.ttfts)
            policy.observe_ttft(now, values[max(0, math.ceil(0.95 * len(values)) - 1)])
        if serving:
            waiting = []
            for r in serving:
                while r.queued and r.queued[0] <= now:
                    r.queued.popleft()
                waiting.append(len(r.queued))
            policy.observe_load(now, LoadSample(tuple(0.0 for _ in serving), tuple(waiting)))
        if any(r.state in (ASLEEP, WAKING) for r in held):
            return  # asleep: no demand to follow
        starting = sum(1 for r in held if r.state == STARTING) + mr.waiting_jobs
        state = ReplicaState(
            replicas=len(held) + mr.waiting_jobs,
            starting=starting,
            min_replicas=1,
            max_replicas=rules.max_replicas,
            cold_start_s=mr.kind.cold_start_s,
            capacity=mr.kind.capacity,
        )
        target = policy.desired_replicas(now, state).replicas
        have = len(held) + mr.waiting_jobs
        for _ in range(target - have):
            submit(m, now)
        surplus = have - target
        while surplus > 0 and mr.waiting_jobs:
            mr.waiting_jobs -= 1
            jobs_waiting.remove(m)
            surplus -= 1
        for r in sorted(held, key=lambda r: (r.state == SERVING, r.free_at, -r.index)):
            if surplus <= 0:
                break
            release(m, r, max(now, r.free_at) if r.state == SERVING else now)
            surplus -= 1

    if rules.dynamic:  # one policy per model, kept through its spells at zero
        for mr in models:
            mr.policy = ForecastPolicy(config)
    else:  # always-on: one serving replica per model from the start
        for mr in models:
            mr.reps.append(Rep(0, mr.kind.gpus, 0.0, 0.0))
            gpus_held += mr.kind.gpus
        peak = gpus_held

    i = 0
    next_pass = 0.0
    now = 0.0
    while i < n or heap:
        t_arr = arr[i] if i < n else INF
        t_heap = heap[0][0] if heap else INF
        if rules.dynamic and next_pass <= min(t_arr, t_heap) and next_pass <= span:
            now = next_pass
            ask = now % POLICY_S < PASS_S / 2
            for m, mr in enumerate(models):
                if mr.reps and (mr.pending or any(r.state != GONE for r in mr.reps)):
                    tick(m, now, ask)
            next_pass += PASS_S
            continue
        if t_heap <= t_arr:
            now, _, m, ri = heapq.heappop(heap)
            ready(m, ri, now)
            continue
        now = t_arr
        rid = i
        i += 1
        m = fleet.model_of[rid]
        mr = models[m]
        note_decode(mr, now, req_out[rid])
        mr.last_busy = max(mr.last_busy, now)
        held = mr.held()
        if any(r.state == SERVING for r in held):
            found[rid] = AWAKE_FOUND
        elif any(r.state in (ASLEEP, WAKING) for r in held):
            found[rid] = ASLEEP_FOUND
        else:
            found[rid] = ZERO_FOUND
        if mr.policy is not None:
            mr.policy.observe_arrival(now, req_in[rid])
        if rules.dynamic:
            if not held and not mr.waiting_jobs:
                submit(m, now + PASS_S / 2)  # the next pass sees the held request
            elif any(r.state == ASLEEP for r in held) and not any(r.state == SERVING for r in held):
                wake(m, now + MESH_HOP_S)
        if found[rid] == AWAKE_FOUND:
            serve(m, rid, now)
        else:
            mr.pending.append(rid)
    for mr in models:
        for r in mr.reps:
            if r.state != GONE:
                bill(r, max(now, span))
    return Outcome(
        policy=rules.name,
        ttft_s=ttft,
        found=found,
        gpu_s=gpu_s,
        gpu_s_asleep=gpu_s_asleep,
        cold_starts=cold_starts,
        wake_ups=wake_ups,
        peak_gpus=peak,
        budget_waits=budget_waits,
        wall_s=time.monotonic() - wall,
    )


# -- figures -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """First-token times of a group of requests: count and percentiles (inf: not served)."""

    requests: int
    p10_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float
    within: float  # share within the objective

    @staticmethod
    def of(values: list[float], objective_s: float) -> Spread:
        v = sorted(values)
        return Spread(
            requests=len(v),
            p10_s=percentile(v, 0.10),
            p50_s=percentile(v, 0.50),
            p90_s=percentile(v, 0.90),
            p99_s=percentile(v, 0.99),
            max_s=v[-1] if v else math.nan,
            within=sum(1 for x in v if x <= objective_s) / len(v) if v else math.nan,
        )


@dataclass(frozen=True)
class Figures:
    policy: str
    gpu_hours: float
    gpu_hours_asleep: float
    saving_vs_always_on: float
    within: float
    awake: Spread
    asleep: Spread
    zero: Spread
    cold_starts: int
    wake_ups: int
    mean_gpus: float
    peak_gpus: int
    budget_waits: int
    wall_s: float


def figures(out: Outcome, span_s: float, objective_s: float, always_on_gpu_s: float) -> Figures:
    groups: dict[str, list[float]] = {AWAKE_FOUND: [], ASLEEP_FOUND: [], ZERO_FOUND: []}
    for t, f in zip(out.ttft_s, out.found, strict=True):
        groups[f].append(t)
    n = len(out.ttft_s)
    return Figures(
        policy=out.policy,
        gpu_hours=out.gpu_s / 3600,
        gpu_hours_asleep=out.gpu_s_asleep / 3600,
        saving_vs_always_on=1 - out.gpu_s / always_on_gpu_s if always_on_gpu_s else math.nan,
        within=sum(1 for t in out.ttft_s if t <= objective_s) / n if n else math.nan,
        awake=Spread.of(groups[AWAKE_FOUND], objective_s),
        asleep=Spread.of(groups[ASLEEP_FOUND], objective_s),
        zero=Spread.of(groups[ZERO_FOUND], objective_s),
        cold_starts=out.cold_starts,
        wake_ups=out.wake_ups,
        mean_gpus=out.gpu_s / span_s if span_s else math.nan,
        peak_gpus=out.peak_gpus,
        budget_waits=out.budget_waits,
        wall_s=out.wall_s,
    )


def fmt(value: float, digits: int = 2) -> str:
    if math.isnan(value):
        return "-"
    if value == INF:
        return "inf"
    return f"{value:.{digits}f}"


def rules_for(name: str, args: argparse.Namespace) -> Rules:
    if name == "always-on":
        return Rules(name, dynamic=False)
    if name == "ours":
        return Rules(name, True, args.sleep_after, args.idle_to_zero)
    if name == "ours-nosleep":
        return Rules(name, True, INF, args.idle_to_zero)
    return Rules(name, True, args.sleep_after, args.what_if_idle_to_zero, sleep_billed=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--models", type=int, default=40)
    parser.add_argument("--zipf", type=float, default=1.5, help="popularity: P(rank k) ~ k^-s")
    parser.add_argument(
        "--share", type=float, default=0.1, help="the share of the day's requests kept"
    )
    parser.add_argument(
        "--idle-sweep",
        default="60,120,300,600,1800",
        help="also run ours with each of these idle-to-zero times, s ('' for none)",
    )
    parser.add_argument("--day-hours", type=float, default=24.0)
    parser.add_argument("--trough", type=float, default=0.2, help="trough / peak request rate")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--budget-gpus", type=int, help="default: the always-on fleet's GPUs")
    parser.add_argument("--queue-wait", type=float, default=30.0, help="Slurm queue wait, s")
    parser.add_argument("--storage-gbs", type=float, default=2.0, help="weights read, GB/s")
    parser.add_argument("--h2d-gbs", type=float, default=25.0, help="wake-up copy, GB/s per GPU")
    parser.add_argument("--sleep-after", type=float, default=60.0, help="ours: idle s to sleep")
    parser.add_argument("--idle-to-zero", type=float, default=600.0, help="idle s to zero")
    parser.add_argument("--what-if-idle-to-zero", type=float, default=3600.0)
    parser.add_argument("--objective", type=float, default=2.0, help="TTFT objective, s")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--quick", action="store_true", help="one hour, 12 models")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    if args.quick:
        args.day_hours = min(args.day_hours, 1.0)
        args.models = min(args.models, 12)
        args.idle_sweep = "120"
    if args.models < 1 or args.zipf <= 0 or args.day_hours <= 0 or not 0 < args.share <= 1:
        parser.error("need --models >= 1, --zipf > 0, --day-hours > 0, 0 < --share <= 1")
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in names:
        if name not in POLICIES:
            parser.error(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    started = time.monotonic()
    say = print
    hour = load_trace(args.trace, 1.0, None)
    trace = thin(diurnal_trace(hour, args.day_hours, args.trough, args.seed), args.share, args.seed)
    fleet = make_fleet(trace, args)
    always_gpus = sum(k.gpus for k in fleet.kinds)
    if args.budget_gpus is None:
        args.budget_gpus = always_gpus
    say(f"bench/fleet: {ATTRIBUTION}")
    say(
        f"{len(trace)} requests over {trace.span_s / 3600:.1f} h (a diurnal day from the "
        f"hour, trough {args.trough:.0%}, {args.share:.0%} of its requests); {args.models} "
        f"models on {GPU}, Zipf s={args.zipf:g}; "
        f"GPU budget {args.budget_gpus} (always-on needs {always_gpus}); TTFT objective "
        f"{args.objective:g} s; seed {args.seed}"
    )
    counts = [0] * args.models
    for m in fleet.model_of:
        counts[m] += 1
    say("\nrank  model            GPUs  requests  cold start  wake-up")
    shown = sorted({0, 1, 2, 4, 9, 19, args.models - 1} & set(range(args.models)))
    for m in shown:
        k = fleet.kinds[m]
        say(
            f"{m + 1:>4}  {k.model:16} {k.gpus:>4} {counts[m]:>9} {k.cold_start_s:>10.1f}s "
            f"{k.wake_s:>7.2f}s"
        )
    idle_models = sum(1 for c in counts if c / max(trace.span_s, 1) * args.idle_to_zero < 1)
    say(
        f"({idle_models} of {args.models} models get fewer than one request per "
        f"idle-to-zero time, {args.idle_to_zero:g} s, on average)"
    )
    results: dict[str, Figures] = {}
    always_gpu_s = always_gpus * trace.span_s
    for name in names:
        out = simulate(trace, fleet, rules_for(name, args), args)
        results[name] = figures(out, trace.span_s, args.objective, always_gpu_s)
    say(
        f"\n{'policy':13} {'GPU-h':>7} {'saved':>6} {'asleep':>6} {'in obj%':>7} "
        f"{'awake in obj%':>13} {'cold':>5} {'wakes':>5} {'mean GPUs':>9} {'peak':>4}"
    )
    for name, f in results.items():
        say(
            f"{name:13} {f.gpu_hours:>7.1f} {100 * f.saving_vs_always_on:>5.1f}% "
            f"{f.gpu_hours_asleep:>6.1f} {100 * f.within:>7.2f} {100 * f.awake.within:>13.2f} "
            f"{f.cold_starts:>5} {f.wake_ups:>5} {f.mean_gpus:>9.1f} {f.peak_gpus:>4}"
        )
    say(
        "\nfirst-token time, s, by what the request found: "
        "requests  p10  p50  p90  p99  max  (in obj%)"
    )
    for name, f in results.items():
        for label, s in (("awake", f.awake), ("asleep", f.asleep), ("at zero", f.zero)):
            if not s.requests:
                continue
            say(
                f"{name:13} {label:8} {s.requests:>8} {fmt(s.p10_s):>6} {fmt(s.p50_s):>6} "
                f"{fmt(s.p90_s):>6} {fmt(s.p99_s):>7} {fmt(s.max_s):>7}  "
                f"({fmt(100 * s.within, 1)})"
            )
    sweep: dict[str, Figures] = {}
    idles = [float(x) for x in args.idle_sweep.split(",") if x.strip()]
    if idles:
        say(
            f"\nours with other idle-to-zero times (sleep after {args.sleep_after:g} s): "
            "GPU-h, saved, in obj%, awake in obj%, found at zero, its first token p50 / p90"
        )
        for idle in idles:
            rules = Rules(f"ours, zero after {idle:g} s", True, args.sleep_after, idle)
            f = sweep[f"{idle:g}"] = figures(
                simulate(trace, fleet, rules, args), trace.span_s, args.objective, always_gpu_s
            )
            zero_share = f.zero.requests / len(trace)
            say(
                f"   {idle:>6g} s {f.gpu_hours:>7.1f} {100 * f.saving_vs_always_on:>5.1f}% "
                f"{100 * f.within:>6.2f} {100 * f.awake.within:>6.2f} "
                f"{100 * zero_share:>5.1f}% {fmt(f.zero.p50_s, 1):>6} {fmt(f.zero.p90_s, 1):>6}"
            )
    checks: dict[str, bool] = {}
    if "ours" in results and "always-on" in results:
        ours = results["ours"]
        checks = {
            ">= 60% fewer GPU-hours than always-on": ours.saving_vs_always_on >= SAVING_TARGET,
            ">= 99% of requests to awake models within the objective": (
                ours.awake.within >= AWAKE_TARGET
            ),
        }
        say(
            f"\ntarget (ours): {100 * ours.saving_vs_always_on:.1f}% fewer GPU-hours than "
            f"always-on, {100 * ours.awake.within:.2f}% of the requests that found their model "
            f"awake within {args.objective:g} s"
        )
        for label, ok in checks.items():
            say(f"   {label}: {'MET' if ok else 'MISSED'}")
        meeting = [
            (float(idle), f)
            for idle, f in sweep.items()
            if f.saving_vs_always_on >= SAVING_TARGET and f.awake.within >= AWAKE_TARGET
        ]
        if meeting:
            idle, f = max(meeting, key=lambda x: x[0])
            say(
                f"   both met with idle-to-zero <= {idle:g} s: {100 * f.saving_vs_always_on:.1f}% "
                f"fewer, but {100 * f.zero.requests / len(trace):.1f}% of the requests then find "
                f"their model at zero (first token p50 {fmt(f.zero.p50_s, 1)} s) and "
                f"{100 * f.within:.2f}% of all are within the objective"
            )
    say(f"\ntotal {time.monotonic() - started:.1f}s")
    if args.json:
        out_json: dict[str, object] = {
            "attribution": ATTRIBUTION,
            "requests": len(trace),
            "span_s": trace.span_s,
            "models": [
                {"rank": m + 1, "requests": counts[m], **asdict(k)}
                for m, k in enumerate(fleet.kinds)
            ],
            "budget_gpus": args.budget_gpus,
            "always_on_gpus": always_gpus,
            "args": {k: v for k, v in vars(args).items() if k != "trace"},
            "policies": {name: asdict(f) for name, f in results.items()},
            "idle_sweep": {idle: asdict(f) for idle, f in sweep.items()},
            "targets": checks,
        }
        args.json.write_text(json.dumps(out_json, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
