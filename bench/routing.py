"""Routing quality on simulated engines with prefix caches, through real agents.

For every (workload, policy) cell the bench starts a fresh local mesh (``LocalMesh``): ``--nodes``
serving agents, each supervising a simulated engine (``python -m fabricnode.simengine``: the same
GPU profile and model size everywhere, continuous batching under a KV-token budget, a block
prefix cache with LRU eviction, vLLM's metric names), plus one ingress agent without an engine,
started with ``--policy NAME``. Closed-loop clients (trio + httpx, streaming chat completions)
talk to the ingress only. A fresh mesh per cell means cold prefix caches and no carry-over
between policies; the workloads are seeded, and the engines answer a prompt deterministically,
so every policy runs the same client programs (bench/_routing_workloads.py):

  tot         SkyLB's Tree of Thoughts: 2-branch, depth-4 trees (15 requests), a child's prompt =
              its parent's prompt + answer + a short turn; children of a node are sent
              concurrently; a quarter of the trees share popular roots across clients
  chat        multi-turn conversations, each turn = history + previous answer + new message,
              with ``X-Session-ID``; ``chat-nosid`` (not run by default): the same
              conversations without it
  nosharing   the tot tree shape and concurrency, every prompt unique random text of the length
              the tot prompt would have

Per cell: ``--warmup`` seconds of load (client starts staggered over it), then
``--seconds`` measured. Reported over requests that *completed* in the measured window:

  req/s, tok/s   completed requests and streamed content chunks (= output tokens) per second
  TTFT p50/p90   send to first content chunk, at the client, seconds (includes any time the
                 ingress held the request: the pending-aware policy queues at the ingress)
  E2E p50/p90    send to the end of the stream, seconds
  hit%           prefix cache hits / queries (tokens) over the window, summed over engines
                 (``vllm:prefix_cache_{hits,queries}_total`` deltas from every engine's /metrics;
                 engine URLs from the ingress's ``/fabric/v1/nodes`` entries)
  wait           mean ``vllm:num_requests_waiting`` per engine, sampled every 0.5 s: queueing
  spread         share of the window's requests served by each node, percent
  holds          HOLD decisions at the ingress (``fabric_ingress_policy_decisions_total``)
  err            requests that failed (non-200, error event, exception)
  cpu            cores used by the agents, engines and this client over the window; host% is
                 the whole machine's busy share (other work on a shared host shows there)

Calibration (defaults; see ``--help``): SkyLB's testbed, Llama-3.1-8B on one 24 GB L4 per
replica (the simulated ``L4`` profile: 121 TFLOPS, 300 GB/s), in real time (``--speed 1``).
Prefill costs ~0.26 ms/token of compute against ~67 ms per (memory-bound) decode step.
``--kv-tokens 30000`` per engine is what vLLM leaves for KV on that card (0.9 x 22.5 GiB - 15 GiB
of weights - ~1.3 GiB of activations and CUDA graphs, at 128 KiB/token); the simulated prefix
cache has the same capacity. The engines admit optimistically and preempt under KV pressure, as
vLLM does. At 30 tree clients (1 to 8 requests in flight each) the KV budget binds: a policy
that spreads every tree over every node both misses the cache and fills the KV with copies of
the same prefixes, so requests queue and get preempted. ``--kv-tokens 40000`` (SGLang's larger
static pool) is the regime where round robin still fits everything; docs/benchmarks-history.md
reports both. The token rate through the relays (~0.9k chunks/s) is well within what two shared
cores carry; the "cpu" and "host%" columns show whether that held.

Targets (issue 4): on tot, the default policy (``routing.DEFAULT_POLICY``) >= 1.27x round-robin
throughput and >= 5x lower P90 TTFT; on nosharing, within 5% of least-load throughput.

    python bench/routing.py                          # 3 workloads x 4 policies, ~10 minutes
    python bench/routing.py --workloads tot --policies round-robin,prefix-pending --json out.json
    python bench/routing.py --quick                  # smoke run, ~30 s

Every process is started through ``LocalMesh`` (own session, parent-death signal) and killed when
its cell ends, whatever happens; work files (logs) live in a temporary directory, kept with
``--keep-workdir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python bench/routing.py` from anywhere finds fabricnode
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import httpx  # noqa: E402
import orjson  # noqa: E402
import trio  # noqa: E402
from _procs import cpu_ticks, descendants, free_port, host_ticks  # noqa: E402
from _routing_workloads import (  # noqa: E402
    TRACE_ATTRIBUTION,
    WORKLOADS,
    Call,
    Shape,
    SharedPrompts,
    Workload,
)

from cli.localmesh import AgentProcess, LocalMesh, wait_until  # noqa: E402
from fabricnode.dataplane import routing  # noqa: E402
from fabricnode.engine.metrics import parse_samples  # noqa: E402

MODEL = "sim-8b"
# A policy named "vllm-router:POLICY" is no policy of ours: vllm-router (the Rust router, from
# PyPI, in its own venv: bench/_venvs.py) with that policy in front of the same engines, the
# clients talking to it instead of the ingress. cache_aware is its prefix-tree policy.
PEER_PREFIX = "vllm-router:"
PEER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
TRACE = REPO.parent / "shared" / "data" / "azure-llm-2023-conv.csv"
CHAT_PATH = "/v1/chat/completions"
DEFAULT_WORKLOADS = ("tot", "chat", "nosharing")
QUICK_SHAPE = Shape(
    system_words=60,
    problem_words=(150, 250),
    output_tokens=(6, 16),
    document_words=(150, 250),
    user_words=(10, 30),
    turns=3,
)


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def default_policies() -> list[str]:
    out = ["round-robin", "least-load", "prefix", routing.DEFAULT_POLICY]
    return list(dict.fromkeys(out))


# -- one cell -------------------------------------------------------------------------------------


@dataclass
class Record:
    start: float
    end: float
    ttft: float | None
    tokens: int
    node: str
    error: str = ""


@dataclass
class EngineCounters:
    hits: float = 0.0
    queries: float = 0.0
    waiting: float = 0.0
    running: float = 0.0


@dataclass
class CellResult:
    workload: str
    policy: str
    window_s: float
    requests: int
    errors: int
    req_s: float
    tok_s: float
    ttft_p50: float
    ttft_p90: float
    e2e_p50: float
    e2e_p90: float
    hit_rate: float
    mean_waiting: float
    mean_running: float
    spread: list[float]
    holds: int
    cpu_cores: float
    host_busy: float
    cpu_by_role: dict[str, float] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)


@dataclass
class Settings:
    nodes: int
    clients: int
    warmup_s: float
    seconds: float
    seed: int
    gpu: str
    params_b: float
    speed: float
    kv_tokens: int
    max_num_seqs: int
    shape: Shape
    source: str = ""  # another checkout whose agents (not engines) run the cell; "" = this one
    via: str = "ingress"  # "agents": client c talks to serving agent c mod nodes, not the ingress


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def engine_args(s: Settings, port: int, seed: int) -> list[str]:
    """``fabric start`` arguments supervising one simulated engine on ``port``. With
    ``--source`` the agents run another checkout's code but the engines stay this one's
    (``-P`` keeps the agent's folder off the engine's path), so only the agents differ."""
    python = [sys.executable, "-m"]
    if s.source:
        python = ["env", f"PYTHONPATH={REPO}", sys.executable, "-P", "-m"]
    return [
        "--sim-gpu",
        s.gpu,
        "--engine-url",
        f"http://127.0.0.1:{port}",
        "--",
        *python,
        "fabricnode.simengine",
        "--model",
        MODEL,
        "--port",
        str(port),
        "--gpu",
        s.gpu,
        "--params-b",
        f"{s.params_b:g}",
        "--speed",
        f"{s.speed:g}",
        "--kv-tokens",
        str(s.kv_tokens),
        "--max-num-seqs",
        str(s.max_num_seqs),
        "--seed",
        str(seed),
    ]


def start_mesh(mesh: LocalMesh, policy: str, s: Settings) -> tuple[AgentProcess, dict[str, str]]:
    """The ingress and the serving agents; returns the ingress and engine URL by session id."""
    agent_policy = routing.DEFAULT_POLICY if policy.startswith(PEER_PREFIX) else policy
    ingress = mesh.start("ingress", args=["--policy", agent_policy], wait=False)
    # Same engine seed everywhere: a prompt gets the same answer on every node, so the
    # programs (which grow from answers) do not depend on where a request went.
    nodes = [
        mesh.start(f"n{i}", args=engine_args(s, free_port(), seed=0), wait=False)
        for i in range(s.nodes)
    ]
    for agent in (ingress, *nodes):
        agent.wait_ready(60)
    wanted = {a.session_id for a in nodes}
    engines: dict[str, str] = {}

    def ready() -> bool:
        # SERVING with an engine URL and a load report, as the ingress sees every node.
        try:
            r = httpx.get(ingress.http_url + "/fabric/v1/nodes", timeout=2)
            entries = r.json()["nodes"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        engines.clear()
        for e in entries:
            if (
                e.get("session_id") in wanted
                and e.get("state") == "serving"
                and (e.get("engine") or {}).get("url")
                and e.get("load")
            ):
                engines[e["session_id"]] = e["engine"]["url"]
        return len(engines) == len(wanted)

    if not wait_until(ready, 60, interval_s=0.1):
        raise RuntimeError(f"only {len(engines)} of {len(wanted)} nodes became ready")
    if not wait_until(lambda: _models_count(ingress) == len(wanted), 30, interval_s=0.1):
        raise RuntimeError("the ingress does not route to every node")
    return ingress, engines


def _models_count(ingress: AgentProcess) -> int:
    try:
        r = httpx.get(ingress.http_url + "/v1/models", timeout=2)
        return sum(m.get("fabric_nodes", 0) for m in r.json()["data"] if m["id"] == MODEL)
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


class Driver:
    """Closed-loop clients running one workload against the ingress, in trio."""

    def __init__(self, urls: list[str], workload: Workload, http: httpx.AsyncClient) -> None:
        # Client c talks to urls[c mod len(urls)]: the ingress, or each serving agent in turn.
        self.urls = [u + CHAT_PATH for u in urls]
        self.workload = workload
        self.http = http
        self.records: list[Record] = []

    async def send(self, call: Call) -> str | None:
        """One streamed request; the answer's text, or None when it failed."""
        body = {
            "model": MODEL,
            "messages": list(call.messages),
            "max_tokens": call.max_tokens,
            "stream": True,
        }
        headers = {"content-type": "application/json"}
        if call.session is not None:
            headers["x-session-id"] = call.session
        start = trio.current_time()
        ttft: float | None = None
        pieces: list[str] = []
        node = ""
        error = ""
        try:
            url = self.urls[call.client % len(self.urls)]
            async with self.http.stream(
                "POST", url, content=orjson.dumps(body), headers=headers
            ) as r:
                node = r.headers.get("x-fabric-node", "")
                if r.status_code != 200:
                    error = f"status {r.status_code}: {(await r.aread())[:120]!r}"
                else:
                    error = "stream ended without [DONE]"
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            error = ""
                            break
                        doc = orjson.loads(data)
                        if "error" in doc:
                            error = f"error event: {str(doc['error'])[:120]}"
                            break
                        for choice in doc.get("choices") or ():
                            text = (choice.get("delta") or {}).get("content")
                            if text:
                                if ttft is None:
                                    ttft = trio.current_time() - start
                                pieces.append(text)
        except (httpx.HTTPError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:160]
        self.records.append(Record(start, trio.current_time(), ttft, len(pieces), node, error))
        return None if error else "".join(pieces)

    async def program(self, call: Call) -> None:
        output = await self.send(call)
        if output is None:
            return
        follow = self.workload.follow(call, output)
        if len(follow) == 1:
            await self.program(follow[0])
        elif follow:
            async with trio.open_nursery() as nursery:
                for child in follow:
                    nursery.start_soon(self.program, child)

    async def client(self, index: int, delay_s: float) -> None:
        await trio.sleep(delay_s)
        n = 0
        while True:
            await self.program(self.workload.first(index, n))
            n += 1


async def scrape_engines(http: httpx.AsyncClient, engines: dict[str, str]) -> dict[str, Any]:
    out: dict[str, EngineCounters] = {}

    async def one(sid: str, url: str) -> None:
        c = EngineCounters()
        try:
            r = await http.get(url + "/metrics", timeout=5)
            for sample in parse_samples(r.text):
                name = sample.name
                if name == "vllm:prefix_cache_hits_total":
                    c.hits += sample.value
                elif name == "vllm:prefix_cache_queries_total":
                    c.queries += sample.value
                elif name == "vllm:num_requests_waiting":
                    c.waiting += sample.value
                elif name == "vllm:num_requests_running":
                    c.running += sample.value
        except httpx.HTTPError:
            c = EngineCounters(math.nan, math.nan, math.nan, math.nan)
        out[sid] = c

    async with trio.open_nursery() as nursery:
        for sid, url in engines.items():
            nursery.start_soon(one, sid, url)
    return out


async def ingress_holds(http: httpx.AsyncClient, url: str) -> int:
    try:
        r = await http.get(url + "/metrics", timeout=5)
    except httpx.HTTPError:
        return 0
    return int(
        sum(
            s.value
            for s in parse_samples(r.text)
            if s.name == "fabric_ingress_policy_decisions_total" and s.label("outcome") == "hold"
        )
    )


async def drive_cell(
    workload: Workload,
    ingress_urls: list[str],
    engines: dict[str, str],
    s: Settings,
    roles: dict[str, list[int]],
) -> tuple[list[Record], dict[str, Any]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1000)
    timeout = httpx.Timeout(300.0, connect=10.0)
    async with (
        httpx.AsyncClient(limits=limits, timeout=timeout) as http,
        httpx.AsyncClient(timeout=5.0) as control,
    ):
        driver = Driver(ingress_urls, workload, http)
        stats: dict[str, Any] = {}
        samples: list[dict[str, EngineCounters]] = []
        async with trio.open_nursery() as nursery:
            for c in range(s.clients):
                nursery.start_soon(driver.client, c, s.warmup_s * c / max(1, s.clients))
            await trio.sleep(s.warmup_s)
            t0 = trio.current_time()
            before = await scrape_engines(control, engines)
            holds0 = sum([await ingress_holds(control, u) for u in ingress_urls])
            cpu0, host0 = {k: cpu_ticks(v) for k, v in roles.items()}, host_ticks()
            end = t0 + s.seconds
            while trio.current_time() + 0.5 < end:
                await trio.sleep(0.5)
                samples.append(await scrape_engines(control, engines))
            await trio.sleep_until(end)
            t1 = trio.current_time()
            cpu1, host1 = {k: cpu_ticks(v) for k, v in roles.items()}, host_ticks()
            after = await scrape_engines(control, engines)
            holds1 = sum([await ingress_holds(control, u) for u in ingress_urls])
            nursery.cancel_scope.cancel()
        hits = sum(after[k].hits - before[k].hits for k in engines)
        queries = sum(after[k].queries - before[k].queries for k in engines)
        clk = os.sysconf("SC_CLK_TCK")
        stats.update(
            t0=t0,
            t1=t1,
            hit_rate=hits / queries if queries > 0 else math.nan,
            holds=holds1 - holds0,
            mean_waiting=_mean([c.waiting for smp in samples for c in smp.values()]),
            mean_running=_mean([c.running for smp in samples for c in smp.values()]),
            cpu_by_role={k: (cpu1[k] - cpu0[k]) / clk / (t1 - t0) for k in roles},
            host_busy=(host1[0] - host0[0]) / max(1, host1[1] - host0[1]),
        )
        return driver.records, stats


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.fmean(values) if values else math.nan


def start_peer_router(
    policy: str, engines: dict[str, str], workdir: Path
) -> subprocess.Popen[bytes]:
    """vllm-router with ``policy`` in front of ``engines``; returns once it answers /health."""
    import _venvs

    venv = _venvs.ensure("vllm-router")
    port = free_port()
    argv = _venvs.vllm_router_argv(venv, port, list(engines.values()), policy, free_port())
    with open(workdir / "vllm-router.log", "wb") as err:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    proc.url = url  # type: ignore[attr-defined]

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}")
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    if not wait_until(healthy, 60, interval_s=0.1):
        proc.kill()
        raise RuntimeError("vllm-router did not become healthy in 60 s")
    return proc


def run_cell(workload_name: str, policy: str, s: Settings, workdir: Path) -> CellResult:
    workload = WORKLOADS[workload_name](seed=s.seed, shape=s.shape)
    cell_dir = workdir / f"{workload_name}-{policy.replace(':', '-')}"
    source = Path(s.source) if s.source else None
    with LocalMesh(cell_dir, log_level="warning", source=source) as mesh:
        ingress, engines = start_mesh(mesh, policy, s)
        names = {a.session_id: a.name for a in mesh.agents}
        serving = [a.pid for a in mesh.agents if a is not ingress]
        roles = {
            "client": [os.getpid()],
            "ingress": [ingress.pid],
            "agents": serving,
            "engines": [p for p in descendants(*serving) if p not in serving],
        }
        peer: subprocess.Popen[bytes] | None = None
        targets = [ingress.http_url]
        if policy.startswith(PEER_PREFIX):
            peer = start_peer_router(policy[len(PEER_PREFIX) :], engines, cell_dir)
            targets = [peer.url]  # type: ignore[attr-defined]
            roles["ingress"] = [peer.pid]
        elif s.via == "agents":
            targets = [a.http_url for a in mesh.agents if a is not ingress]
        try:
            records, stats = trio.run(drive_cell, workload, targets, engines, s, roles)
        finally:
            if peer is not None:
                peer.kill()
                peer.wait()
            for agent in mesh.agents:
                if not agent.running:
                    log(f"{agent.name} exited early: {agent.stderr_tail(3)}")
    t0, t1 = stats["t0"], stats["t1"]
    window = [r for r in records if t0 <= r.end <= t1]
    ok = [r for r in window if not r.error]
    errors = [r for r in window if r.error]
    served = Counter(names.get(r.node, "?") for r in ok)
    spread = [100.0 * served[f"n{i}"] / max(1, len(ok)) for i in range(s.nodes)]
    length = t1 - t0
    return CellResult(
        workload=workload_name,
        policy=policy,
        window_s=length,
        requests=len(ok),
        errors=len(errors),
        req_s=len(ok) / length,
        tok_s=sum(r.tokens for r in ok) / length,
        ttft_p50=percentile([r.ttft for r in ok if r.ttft is not None], 0.5),
        ttft_p90=percentile([r.ttft for r in ok if r.ttft is not None], 0.9),
        e2e_p50=percentile([r.end - r.start for r in ok], 0.5),
        e2e_p90=percentile([r.end - r.start for r in ok], 0.9),
        hit_rate=stats["hit_rate"],
        mean_waiting=stats["mean_waiting"],
        mean_running=stats["mean_running"],
        spread=spread,
        holds=stats["holds"],
        cpu_cores=sum(stats["cpu_by_role"].values()),
        cpu_by_role=stats["cpu_by_role"],
        host_busy=stats["host_busy"],
        error_samples=sorted({r.error for r in errors})[:3],
    )


# -- report ---------------------------------------------------------------------------------------

COLUMNS: list[tuple[str, int, Callable[[CellResult], str]]] = [
    ("workload", 10, lambda c: c.workload),
    ("policy", 14, lambda c: c.policy),
    ("req/s", 6, lambda c: f"{c.req_s:.2f}"),
    ("tok/s", 6, lambda c: f"{c.tok_s:.0f}"),
    ("TTFT p50", 8, lambda c: f"{c.ttft_p50:.2f}"),
    ("p90", 6, lambda c: f"{c.ttft_p90:.2f}"),
    ("E2E p50", 7, lambda c: f"{c.e2e_p50:.2f}"),
    ("p90", 6, lambda c: f"{c.e2e_p90:.2f}"),
    ("hit%", 5, lambda c: f"{100 * c.hit_rate:.1f}"),
    ("wait", 5, lambda c: f"{c.mean_waiting:.1f}"),
    ("run", 5, lambda c: f"{c.mean_running:.1f}"),
    ("spread %", 15, lambda c: "/".join(f"{x:.0f}" for x in c.spread)),
    ("holds", 5, lambda c: str(c.holds)),
    ("err", 3, lambda c: str(c.errors)),
    ("n", 5, lambda c: str(c.requests)),
    ("cpu", 4, lambda c: f"{c.cpu_cores:.2f}"),
    ("host%", 5, lambda c: f"{100 * c.host_busy:.0f}"),
]


def table(cells: list[CellResult]) -> str:
    def row(values: list[str]) -> str:
        out = []
        for (name, width, _), v in zip(COLUMNS, values, strict=True):
            out.append(
                v.ljust(width) if name in ("workload", "policy", "spread %") else v.rjust(width)
            )
        return "  ".join(out).rstrip()

    lines = [row([name for name, _, _ in COLUMNS])]
    lines.append("-" * len(lines[0]))
    lines.extend(row([fmt(c) for _, _, fmt in COLUMNS]) for c in cells)
    return "\n".join(lines)


def find(cells: list[CellResult], workload: str, policy: str) -> CellResult | None:
    return next((c for c in cells if c.workload == workload and c.policy == policy), None)


def targets(cells: list[CellResult], default: str) -> list[dict[str, Any]]:
    """Issue 4's targets, for the cells that were run."""
    out: list[dict[str, Any]] = []
    tot_d, tot_rr = find(cells, "tot", default), find(cells, "tot", "round-robin")
    if tot_d and tot_rr:
        ratio = tot_d.req_s / tot_rr.req_s if tot_rr.req_s else math.nan
        out.append(
            {
                "target": f"tot: {default} throughput >= 1.27x round-robin",
                "value": ratio,
                "shown": f"{ratio:.2f}x",
                "met": ratio >= 1.27,
            }
        )
        ttft = tot_rr.ttft_p90 / tot_d.ttft_p90 if tot_d.ttft_p90 else math.nan
        out.append(
            {
                "target": f"tot: {default} P90 TTFT >= 5x lower than round-robin",
                "value": ttft,
                "shown": f"{ttft:.2f}x lower ({tot_d.ttft_p90:.2f} s vs {tot_rr.ttft_p90:.2f} s)",
                "met": ttft >= 5.0,
            }
        )
    ns_d, ns_ll = find(cells, "nosharing", default), find(cells, "nosharing", "least-load")
    if ns_d and ns_ll:
        ratio = ns_d.req_s / ns_ll.req_s if ns_ll.req_s else math.nan
        out.append(
            {
                "target": f"nosharing: {default} throughput within 5% of least-load",
                "value": ratio,
                "shown": f"{ratio:.3f}x",
                "met": ratio >= 0.95,
            }
        )
    return out


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/routing.py",
        description="Routing quality of fabric's policies on simulated engines with prefix caches.",
    )
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), help="comma-separated")
    p.add_argument("--policies", default=",".join(default_policies()), help="comma-separated")
    p.add_argument("--seconds", type=float, default=30.0, help="measured seconds per cell (30)")
    p.add_argument("--warmup", type=float, default=8.0, help="unmeasured seconds per cell (8)")
    p.add_argument("--clients", type=int, default=30, help="closed-loop clients (30)")
    p.add_argument("--nodes", type=int, default=4, help="serving agents (4)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    p.add_argument("--gpu", default="L4", help="simulated GPU profile (L4)")
    p.add_argument("--params-b", type=float, default=8.0, help="model size, billions (8)")
    p.add_argument("--speed", type=float, default=1.0, help="engine time factor (1.0)")
    p.add_argument("--kv-tokens", type=int, default=30_000, help="KV tokens per engine (30000)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="engine batch limit (256)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny smoke run (~30 s): the tot workload, 4 clients, 1 + 2.5 s per cell, engines "
        "at speed 2 (flags given beside it still win)",
    )
    p.add_argument("--keep-workdir", action="store_true", help="keep agent logs")
    p.add_argument(
        "--trace",
        type=Path,
        default=TRACE,
        help="the Azure trace shared-prompts takes lengths from",
    )
    p.add_argument(
        "--source",
        metavar="DIR",
        default="",
        help="run the agents from another checkout (e.g. a git worktree of an earlier commit); "
        "the engines and clients stay this checkout's",
    )
    p.add_argument(
        "--via",
        choices=("ingress", "agents"),
        default="ingress",
        help="clients talk to the ingress agent (default), or each to one of the serving agents "
        "(every agent is an ingress; vllm-router cells are unaffected)",
    )
    args = p.parse_args(argv)
    if args.quick:  # other defaults, not other values: flags given beside --quick still win
        p.set_defaults(workloads="tot", seconds=2.5, warmup=1.0, clients=4, speed=2.0)
        args = p.parse_args(argv)
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            p.error(f"unknown workload {name!r} (one of: {', '.join(WORKLOADS)})")
    for name in args.policies.split(","):
        if name.startswith(PEER_PREFIX):
            if name[len(PEER_PREFIX) :] not in PEER_POLICIES:
                p.error(f"unknown vllm-router policy {name!r} (one of: {', '.join(PEER_POLICIES)})")
        elif name not in routing.POLICY_NAMES:
            p.error(f"unknown policy {name!r} (one of: {', '.join(routing.POLICY_NAMES)})")
    if "shared-prompts" in args.workloads.split(","):
        if not args.trace.is_file():
            p.error(f"shared-prompts takes its turn lengths from {args.trace}, which is missing")
        SharedPrompts.load_trace(str(args.trace))
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    settings = Settings(
        nodes=args.nodes,
        clients=args.clients,
        warmup_s=args.warmup,
        seconds=args.seconds,
        seed=args.seed,
        gpu=args.gpu,
        params_b=args.params_b,
        speed=args.speed,
        kv_tokens=args.kv_tokens,
        max_num_seqs=args.max_num_seqs,
        shape=QUICK_SHAPE if args.quick else Shape(),
        source=str(Path(args.source).resolve()) if args.source else "",
        via=args.via,
    )
    workloads = args.workloads.split(",")
    policies = args.policies.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="fabric-bench-routing-"))
    cells: list[CellResult] = []
    began = time.monotonic()
    try:
        for workload in workloads:
            for policy in policies:
                log(f"{workload} x {policy} ...")
                cell = run_cell(workload, policy, settings, workdir)
                cells.append(cell)
                log(
                    f"{workload} x {policy}: {cell.req_s:.2f} req/s, TTFT p90 "
                    f"{cell.ttft_p90:.2f} s, hit {100 * cell.hit_rate:.1f}%, {cell.errors} errors"
                )
    finally:
        if args.keep_workdir:
            log(f"work files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    s = settings
    print(
        f"bench/routing: {s.nodes} nodes x simulated {s.gpu} ({s.params_b:g}B params, "
        f"kv {s.kv_tokens} tokens, speed {s.speed:g}), {s.clients} closed-loop streaming "
        f"clients, {s.warmup_s:g} s warm-up + {s.seconds:g} s measured per cell, seed {s.seed}; "
        f"default policy {routing.DEFAULT_POLICY}; {time.monotonic() - began:.0f} s in all"
        + (f"; agents from {s.source}" if s.source else "")
    )
    print(table(cells))
    if "shared-prompts" in workloads:
        print(TRACE_ATTRIBUTION)
    checks = targets(cells, routing.DEFAULT_POLICY)
    if checks:
        print("targets:")
        for t in checks:
            print(f"  {'MET ' if t['met'] else 'MISS'} {t['target']}: {t['shown']}")
    for c in cells:
        for sample in c.error_samples:
            print(f"  error ({c.workload} x {c.policy}): {sample}")
    if args.json:
        doc = {
            "settings": {**asdict(s), "default_policy": routing.DEFAULT_POLICY},
            "cells": [asdict(c) for c in cells],
            "targets": checks,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return 0


def _interrupted(exc: BaseException) -> bool:
    if isinstance(exc, KeyboardInterrupt):
        return True
    return isinstance(exc, BaseExceptionGroup) and any(map(_interrupted, exc.exceptions))


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BaseException as exc:  # Ctrl-C: one line rather than a trio traceback
        if not _interrupted(exc):
            raise
        log("interrupted; every agent and engine was stopped")
        sys.exit(130)
