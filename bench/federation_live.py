"""The live cell of bench/federation.py: site A at its peak, with real agents over the emulated
WAN, served site-local and with two-layer routing, side by side in one run.

Three sites on the emulated sites of tests/support/sites.py (RTT a-b 40 ms, a-c 150 ms, b-c
250 ms, as the model's A, B and C), each its own mesh and cluster key with one gateway and two
nodes serving the same simulated model (an L4, a few requests at a time, slowed: each node
admits little, so a burst fills a site); site A also has an ingress agent, and every client runs
in its namespace. ``--clients`` closed-loop clients stream chat requests at A's ingress for
``--seconds``, twice:

* **ours**: the gateways up; what A cannot admit is pushed to B and C (``sites`` rules 5, 6);
* **site-local**: the same agents with every gateway stopped; A serves its clients alone.

Per run: the requests answered, the share within the TTFT objective (``--ttft-objective-s``),
their rate, TTFT p50/p90 as the clients measure it (the first content chunk of the stream), and
the share served at B and C. The model (bench/federation.py) predicts, at A's peak, more
answered within the objective with pushing than without and a far lower p90 TTFT: this is where
real agents, sockets and a real WAN delay confirm or contradict it. Root only.

    python bench/federation_live.py                       # 16 clients, 40 s a run
    python bench/federation_live.py --clients 8 --seconds 15 --json out.json   # the smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from cli.localmesh import wait_until  # noqa: E402
from fabricnode.federation.keygen import generate_site_key  # noqa: E402
from tests.support.federation import Federation, start_meshes  # noqa: E402
from tests.support.meshload import sim_engine_args  # noqa: E402
from tests.support.sites import Link, Site, Topology, check_sites, emulated_sites  # noqa: E402

MODEL = "sim-live"
INGRESS = "a-c0"
TOPOLOGY = Topology(
    sites=(Site("a", computes=3), Site("b", computes=2), Site("c", computes=2)),
    links={
        ("a", "b"): Link(rtt_ms=40),
        ("a", "c"): Link(rtt_ms=150),
        ("b", "c"): Link(rtt_ms=250),
    },
)
NODES = {"a": ("a-c1", "a-c2"), "b": ("b-c0", "b-c1"), "c": ("c-c0", "c-c1")}
GATEWAYS = ("a-gw0", "b-gw0", "c-gw0")
PROMPT_WORDS = 400


@dataclass
class Run:
    """What the clients of one run saw."""

    ttfts: list[float] = field(default_factory=list)
    served_at: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)


def client(url: str, i: int, until: float, run: Run, lock: threading.Lock) -> None:
    words = " ".join(f"w{(i * 7919 + k) % 4000}" for k in range(PROMPT_WORDS))
    n = 0
    with httpx.Client(timeout=120) as http:
        while time.monotonic() < until:
            n += 1
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"client {i} request {n}: {words}"}],
                "max_tokens": 32,
                "stream": True,
            }
            sent = time.monotonic()
            first: float | None = None
            try:
                with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        with lock:
                            run.failed[str(r.status_code)] += 1
                        continue
                    site = r.headers.get("x-fabric-site", "a")
                    for line in r.iter_lines():
                        if first is None and line.startswith("data: ") and '"content"' in line:
                            first = time.monotonic()
            except httpx.HTTPError as exc:
                with lock:
                    run.failed[type(exc).__name__] += 1
                continue
            with lock:
                run.ttfts.append((first or time.monotonic()) - sent)
                run.served_at[site] += 1


def burst(fed: Federation, clients: int, seconds: float) -> Run:
    run = Run()
    lock = threading.Lock()
    url = fed.url(INGRESS)
    until = time.monotonic() + seconds
    threads = [
        threading.Thread(
            target=fed.at, args=(INGRESS, lambda i=i: client(url, i, until, run, lock))
        )
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 180)
    return run


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))]


def figures(name: str, run: Run, seconds: float, objective: float) -> dict[str, Any]:
    answered = len(run.ttfts)
    within = sum(1 for t in run.ttfts if t <= objective)
    away = sum(n for s, n in run.served_at.items() if s != "a")
    return {
        "policy": name,
        "answered": answered,
        "failed": dict(run.failed),
        "within": within / answered if answered else float("nan"),
        "good_per_s": within / seconds,
        "ttft_p50": quantile(run.ttfts, 0.5),
        "ttft_p90": quantile(run.ttfts, 0.9),
        "mean_ttft": statistics.fmean(run.ttfts) if run.ttfts else float("nan"),
        "served_elsewhere": away / answered if answered else float("nan"),
        "served_at": dict(run.served_at),
    }


def row(f: dict[str, Any]) -> str:
    return (
        f"{f['policy']:11} {f['answered']:8d} {100 * f['within']:7.1f}% {f['good_per_s']:7.2f} "
        f"{f['ttft_p50']:9.3f} {f['ttft_p90']:8.3f} {100 * f['served_elsewhere']:9.1f}% "
        f"{sum(f['failed'].values()):6d}"
    )


def peers_admit(fed: Federation) -> bool:
    rows = fed.peer_sites("a-gw0")
    for site in ("b", "c"):
        row_ = rows.get(site) or {}
        model = ((row_.get("summary") or {}).get("models") or {}).get(MODEL) or {}
        if not (row_.get("routable") and model.get("replicas") == 2):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--ttft-objective-s", type=float, default=2.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    check_sites()
    small = sim_engine_args(MODEL, "L4", "--max-num-seqs", "2", "--slowdown", "2")
    print(
        f"live cell: 3 sites (RTT a-b 40, a-c 150, b-c 250 ms), 2 nodes a site "
        f"({MODEL}: L4, 2 requests at a time, slowed 2x); {args.clients} streaming clients at "
        f"a for {args.seconds:g} s a run; TTFT objective {args.ttft_objective_s:g} s",
        flush=True,
    )
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fabric-fedlive-") as tmp:
        root = Path(tmp)
        keys = {s.name: generate_site_key(s.name, root / f"key-{s.name}") for s in TOPOLOGY.sites}
        with emulated_sites(TOPOLOGY) as sites:
            fed = Federation(sites, root, keys)
            try:
                start_meshes(fed)
                for site_nodes in NODES.values():
                    for node in site_nodes:
                        fed.start(node, *small)
                fed.start(INGRESS)
                for gw in GATEWAYS:
                    fed.gateway(gw)
                for agent in fed.agents.values():
                    agent.wait_ready(60)
                if not wait_until(lambda: peers_admit(fed), 60):
                    raise SystemExit(f"the peer sites never served: {fed.peer_sites('a-gw0')}")
                served = _serves(fed)
                if not wait_until(served, 30):
                    raise SystemExit("a's ingress never listed the model")
                runs: list[tuple[str, Callable[[], None]]] = [
                    ("ours", lambda: None),
                    ("site-local", lambda: _stop_gateways(fed)),
                ]
                print(
                    f"\n{'policy':11} {'answered':>8} {'within':>8} {'good/s':>7} "
                    f"{'TTFT p50':>9} {'p90':>8} {'elsewhere':>10} {'failed':>6}"
                )
                for name, before in runs:
                    before()
                    run = burst(fed, args.clients, args.seconds)
                    f = figures(name, run, args.seconds, args.ttft_objective_s)
                    results.append(f)
                    print(row(f), flush=True)
            finally:
                fed.close()
    ours, local = results[0], results[1]
    if local["good_per_s"] > 0 and ours["ttft_p90"] > 0:
        print(
            f"\nours / site-local: {ours['good_per_s'] / local['good_per_s']:.2f}x within the "
            f"objective per second, p90 TTFT {local['ttft_p90'] / ours['ttft_p90']:.2f}x lower"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "runs": results}, indent=1))  # fmt: skip
    return 0


def _serves(fed: Federation) -> Callable[[], bool]:
    url = fed.url(INGRESS)

    def serves() -> bool:
        def models() -> Any:
            return httpx.get(f"{url}/v1/models", timeout=5).json()["data"]

        try:
            data = fed.at(INGRESS, models)
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return any(m["id"] == MODEL for m in data)

    return serves


def _stop_gateways(fed: Federation) -> None:
    """Every gateway leaves (SIGTERM: it signs LEFT): A's ingress has nowhere to push to."""
    for gw in GATEWAYS:
        fed.agents[gw].terminate()
    for gw in GATEWAYS:
        fed.agents[gw].wait(30)
    url = fed.url(INGRESS)

    def no_gateway() -> bool:
        def nodes() -> Any:
            return httpx.get(f"{url}/fabric/v1/nodes", timeout=5).json()

        try:
            listed = fed.at(INGRESS, nodes)
        except (httpx.HTTPError, ValueError):
            return False
        rows = listed if isinstance(listed, list) else listed.get("nodes", [])
        return not any(
            (n.get("labels") or {}).get("fabric.gateway") and n.get("state") != "left" for n in rows
        )

    if not wait_until(no_gateway, 30):
        raise SystemExit("a gateway still shows in a's registry")


if __name__ == "__main__":
    sys.exit(main())
