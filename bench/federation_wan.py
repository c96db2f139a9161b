"""Sites over the emulated WAN with real gateway agents: how fast a change at one site reaches
every other, whether a lossy WAN makes a live site look partitioned, and what a gateway sends.

Five sites (default) on the emulated sites of tests/support/sites.py, each its own mesh and
cluster key with one gateway and one compute node; the WAN links' round trips spread evenly from
``--rtt-min-ms`` to ``--rtt-max-ms`` over the pairs, ``--loss`` per packet and direction. Real
agents (``fabric start``) in network namespaces; the figures are read from the gateways' own
``GET /fabric/v1/sites`` and the WAN router's counters:

* **a new entry**: a node serving a new model starts at one site; from the moment its agent
  serves, the time until each other site's gateway lists the model (the summary path: the
  node's entry gossiped to its gateway, the next summary, one WAN crossing); per pair, against
  the pair's RTT plus 2 s. Done from every site in turn.
* **an update**: that node leaves (SIGTERM); from the signal, the time until each other site's
  gateway lists the model with no replica.
* **false partitions**: over ``--steady-s`` of steady state, every gateway's view polled twice a
  second; a sample where a live, connected site is not routable is a false positive.
* **WAN bytes per gateway**: what the router carried out of each site's segment over the steady
  window (summaries, pings, TLS and TCP/IP, retransmissions), per second.

Crash detection and false positives *inside* a site are the mesh's own (bench/gossip.py); the
gateway's CPU and the summary's size by nodes and models, bench/federation_bytes.py. Root only.

    python bench/federation_wan.py                        # 5 sites, 50-250 ms, 1% loss
    python bench/federation_wan.py --sites 3 --steady-s 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fabricnode.federation.keygen import generate_site_key  # noqa: E402
from tests.support.federation import Federation, start_meshes  # noqa: E402
from tests.support.sites import Link, Site, Topology, check_sites, emulated_sites  # noqa: E402


def topology(n: int, rtt_min_ms: float, rtt_max_ms: float, loss: float) -> Topology:
    sites = tuple(Site(f"s{i}", computes=1) for i in range(n))
    pairs = [(a.name, b.name) for i, a in enumerate(sites) for b in sites[i + 1 :]]
    step = (rtt_max_ms - rtt_min_ms) / max(1, len(pairs) - 1)
    links = {
        pair: Link(rtt_ms=round(rtt_min_ms + k * step, 1), loss=loss)
        for k, pair in enumerate(pairs)
    }
    return Topology(sites=sites, links=links, seed=7)


def views(fed: Federation, gateways: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Every gateway's view of its peer sites, read side by side (one thread each)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}

    def read(gw: str) -> None:
        try:
            out[gw] = fed.peer_sites(gw)
        except Exception:  # a gateway that does not answer counts as no view
            out[gw] = {}

    threads = [threading.Thread(target=read, args=(gw,)) for gw in gateways]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def replicas(row: dict[str, Any] | None, model: str) -> int | None:
    if not row or not row.get("summary"):
        return None
    found = row["summary"]["models"].get(model)
    return None if found is None else int(found["replicas"])


def wait_views(
    fed: Federation, gateways: list[str], origin: str, ok: Any, timeout_s: float
) -> dict[str, float]:
    """Per other site, seconds until ``ok(row)`` holds in its gateway's view of ``origin``."""
    t0 = time.monotonic()
    seen: dict[str, float] = {}
    while time.monotonic() - t0 < timeout_s:
        for gw, rows in views(fed, gateways).items():
            site = gw.split("-")[0]
            if site != origin and site not in seen and ok(rows.get(origin)):
                seen[site] = time.monotonic() - t0
        if len(seen) == len(gateways) - 1:
            break
        time.sleep(0.02)
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sites", type=int, default=5)
    ap.add_argument("--rtt-min-ms", type=float, default=50.0)
    ap.add_argument("--rtt-max-ms", type=float, default=250.0)
    ap.add_argument("--loss", type=float, default=0.01)
    ap.add_argument("--steady-s", type=float, default=60.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    check_sites()
    topo = topology(args.sites, args.rtt_min_ms, args.rtt_max_ms, args.loss)
    names = [s.name for s in topo.sites]
    gateways = [f"{n}-gw0" for n in names]
    result: dict[str, Any] = {"sites": args.sites, "loss": args.loss}
    with tempfile.TemporaryDirectory(prefix="fabric-bench-fedwan-") as tmp:
        root = Path(tmp)
        keys = {n: generate_site_key(n, root / f"key-{n}") for n in names}
        with emulated_sites(topo) as sites:
            fed = Federation(sites, root, keys)
            start_meshes(fed)
            try:
                for gw in gateways:
                    fed.gateway(gw)
                for agent in fed.agents.values():
                    agent.wait_ready(60)
                t0 = time.monotonic()
                while True:
                    v = views(fed, gateways)
                    if all(
                        len(v[gw]) == len(names) - 1 and all(r["routable"] for r in v[gw].values())
                        for gw in gateways
                    ):
                        break
                    if time.monotonic() - t0 > 60:
                        raise SystemExit(f"the sites never all saw each other: {v}")
                    time.sleep(0.1)
                result["converged_s"] = round(time.monotonic() - t0, 2)

                # steady state: false partitions, WAN bytes
                before = sites.statistics()
                samples = unroutable = 0
                t0 = time.monotonic()
                while time.monotonic() - t0 < args.steady_s:
                    for rows in views(fed, gateways).values():
                        for row in rows.values():
                            samples += 1
                            unroutable += not row["routable"]
                    time.sleep(0.5)
                window = time.monotonic() - t0
                after = sites.statistics()
                per_gateway = {}
                for n in names:
                    sent = sum(
                        after.direction(n, m).passed_bytes - before.direction(n, m).passed_bytes
                        for m in names
                        if m != n
                    )
                    per_gateway[n] = sent / window / 1000
                result["steady_window_s"] = round(window, 1)
                result["view_samples"] = samples
                result["false_partitions"] = unroutable
                result["wan_kbps_per_gateway"] = {n: round(x, 2) for n, x in per_gateway.items()}

                # a new entry, then an update, from every site in turn
                rtt = {(a, b): topo.link(a, b).rtt_ms / 1000 for a in names for b in names}
                new_rows: list[dict[str, Any]] = []
                for origin in names:
                    model = f"bench-{origin}"
                    node = fed.start(f"{origin}-c0", "--sim", model)
                    node.wait_ready(60)
                    while (
                        fed.get(f"{origin}-c0", f"{origin}-c0", "/fabric/v1/self")["state"]
                        != "serving"
                    ):
                        time.sleep(0.02)
                    seen = wait_views(
                        fed, gateways, origin, lambda row, m=model: replicas(row, m) == 1, 30
                    )
                    node.terminate()  # the update's clock starts at the SIGTERM
                    gone = wait_views(
                        fed, gateways, origin, lambda row, m=model: not replicas(row, m), 30
                    )
                    node.wait(30)
                    for site in names:
                        if site == origin:
                            continue
                        new_rows.append(
                            {
                                "from": origin,
                                "to": site,
                                "rtt_s": rtt[(origin, site)],
                                "new_s": seen.get(site),
                                "update_s": gone.get(site),
                            }
                        )
                result["pairs"] = new_rows
            finally:
                fed.close()
    rows = result["pairs"]
    for key in ("new_s", "update_s"):
        got = [r[key] for r in rows if r[key] is not None]
        within = sum(1 for r in rows if r[key] is not None and r[key] <= r["rtt_s"] + 2.0)
        result[f"{key}_reached"] = f"{len(got)}/{len(rows)}"
        result[f"{key}_within_rtt_plus_2s"] = f"{within}/{len(rows)}"
        result[f"{key}_mean"] = round(statistics.mean(got), 3) if got else None
        result[f"{key}_max"] = round(max(got), 3) if got else None
    kbps = result["wan_kbps_per_gateway"]
    print(
        f"{args.sites} sites, RTT {args.rtt_min_ms:g}-{args.rtt_max_ms:g} ms, loss "
        f"{args.loss:.0%}: every view whole {result['converged_s']} s after the gateways were "
        f"ready"
    )
    print(
        f"a new entry at every other site: {result['new_s_reached']} pairs, mean "
        f"{result['new_s_mean']} s, max {result['new_s_max']} s; within RTT + 2 s: "
        f"{result['new_s_within_rtt_plus_2s']}"
    )
    print(
        f"an update at every other site: {result['update_s_reached']} pairs, mean "
        f"{result['update_s_mean']} s, max {result['update_s_max']} s; within RTT + 2 s: "
        f"{result['update_s_within_rtt_plus_2s']}"
    )
    print(
        f"steady state, {result['steady_window_s']} s: {result['false_partitions']} false "
        f"partitions in {result['view_samples']} view samples; WAN KB/s per gateway: mean "
        f"{statistics.mean(kbps.values()):.2f}, max {max(kbps.values()):.2f} (target <= 50)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
