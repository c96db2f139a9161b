"""The emulated sites of tests/support/sites.py at a larger size than the tests': how long a
topology takes to build and tear down, how close the RTT measured through the WAN router is to
the RTT set on every pair, and what the router's userspace delay costs per packet.

    python bench/sites.py                               # 5 sites x (1 gateway + 8 computes)
    python bench/sites.py --sites 8 --computes 16 --probes 30 --json out.json
    python bench/sites.py --quick                       # 3 sites x 2 computes, a smoke run

Pairs get RTTs spread evenly from ``--rtt-min-ms`` to ``--rtt-max-ms``; every pair's gateways
are probed side by side, ``--probes`` TCP connects each (one RTT: SYN out, SYN-ACK back). The
bulk phase sends ``--bulk-mb`` over one link, shaped to ``--bulk-mbit`` and then unshaped (what
the router process carries at most, one core), and reads the router's CPU from /proc. Root
only (network namespaces); the figures go to docs/benchmarks.md, "Emulated sites".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for path in (REPO, BENCH_DIR):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _procs import cpu_ticks  # noqa: E402

from tests.support.sites import (  # noqa: E402
    Link,
    Site,
    Sites,
    Topology,
    check_sites,
    emulated_sites,
)

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def topology(n_sites: int, computes: int, rtt_min_ms: float, rtt_max_ms: float) -> Topology:
    sites = tuple(Site(f"s{i}", computes=computes) for i in range(n_sites))
    pairs = [(a.name, b.name) for i, a in enumerate(sites) for b in sites[i + 1 :]]
    step = (rtt_max_ms - rtt_min_ms) / max(1, len(pairs) - 1)
    links = {pair: Link(rtt_ms=round(rtt_min_ms + k * step, 1)) for k, pair in enumerate(pairs)}
    return Topology(sites=sites, links=links)


def probe_all(sites: Sites, probes: int) -> list[dict[str, float | str]]:
    rows: list[dict[str, float | str]] = []
    lock = threading.Lock()

    def probe(a: str, b: str) -> None:
        rtts = sites.probe_rtts_ms(f"{a}-gw0", f"{b}-gw0", probes)
        want = sites.link(a, b).rtt_ms
        median = statistics.median(rtts)
        with lock:
            rows.append(
                {
                    "pair": f"{a}-{b}",
                    "set_ms": want,
                    "median_ms": round(median, 3),
                    "min_ms": round(min(rtts), 3),
                    "max_ms": round(max(rtts), 3),
                    "error_pct": round((median / want - 1) * 100, 2),
                }
            )

    threads = [threading.Thread(target=probe, args=p) for p in sites.topology.pairs()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(rows, key=lambda r: float(r["set_ms"]))


def bulk(sites: Sites, a: str, b: str, size: int) -> dict[str, float]:
    """``size`` bytes from a's gateway to b's over TCP: seconds, Mbit/s, router CPU."""
    server = sites.socket(f"{b}-gw0")
    server.bind(("0.0.0.0", 0))
    server.listen(1)
    port = server.getsockname()[1]
    done: list[float] = []

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            while conn.recv(1 << 16):
                pass
        done.append(time.monotonic())

    reader = threading.Thread(target=receive)
    reader.start()
    delay = sites.delay_pid or 0
    before_cpu, before = cpu_ticks([delay]), sites.statistics()
    with sites.socket(f"{a}-gw0") as client:
        client.connect((sites.node(f"{b}-gw0").wan_address, port))
        t0 = time.monotonic()
        client.sendall(bytes(size))
    reader.join(300)
    server.close()
    took = done[0] - t0
    cpu_s = (cpu_ticks([delay]) - before_cpu) / TICKS_PER_S
    packets = sites.statistics().passed - before.passed
    return {
        "seconds": round(took, 3),
        "mbit_s": round(size * 8 / took / 1e6, 2),
        "router_cpu_s": round(cpu_s, 3),
        "router_cores": round(cpu_s / took, 2),
        "packets": packets,
        "router_us_per_packet": round(cpu_s / max(1, packets) * 1e6, 1),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sites", type=int, default=5)
    p.add_argument("--computes", type=int, default=8, help="compute nodes per site")
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--rtt-min-ms", type=float, default=10)
    p.add_argument("--rtt-max-ms", type=float, default=300)
    p.add_argument("--bulk-mb", type=float, default=10)
    p.add_argument("--bulk-mbit", type=float, default=50)
    p.add_argument("--quick", action="store_true", help="3 sites x 2 computes, 5 probes, 2 MB")
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args(argv)
    if args.quick:
        args.sites, args.computes, args.probes, args.bulk_mb = 3, 2, 5, 2
    check_sites()
    topo = topology(args.sites, args.computes, args.rtt_min_ms, args.rtt_max_ms)
    load = os.getloadavg()[0]
    print(
        f"sites: {args.sites} sites x (1 gateway + {args.computes} computes),"
        f" {len(list(topo.pairs()))} pairs, RTTs {args.rtt_min_ms:g}-{args.rtt_max_ms:g} ms;"
        f" load average {load:.2f} on {os.cpu_count()} CPUs"
    )
    result: dict[str, object] = {"args": {k: str(v) for k, v in vars(args).items()}}
    t0 = time.monotonic()
    with emulated_sites(topo) as sites:
        built = time.monotonic() - t0
        print(f"built {len(sites.namespaces())} namespaces in {built:.2f} s")
        t1 = time.monotonic()
        rows = probe_all(sites, args.probes)
        probed = time.monotonic() - t1
        late = sites.statistics()
        print(f"\n{'pair':>8} {'set':>7} {'median':>8} {'min':>8} {'max':>8} {'error':>7}")
        for r in rows:
            print(
                f"{r['pair']:>8} {r['set_ms']:>7} {r['median_ms']:>8} {r['min_ms']:>8}"
                f" {r['max_ms']:>8} {r['error_pct']:>+6.2f}%"
            )
        errors = [abs(float(r["error_pct"])) for r in rows]
        over = [float(r["median_ms"]) - float(r["set_ms"]) for r in rows]
        print(
            f"probes took {probed:.1f} s; |error| max {max(errors):.2f}%, median"
            f" {statistics.median(errors):.2f}%; the median adds {statistics.median(over):.2f} ms;"
            f" releases late by {late.late_s_mean * 1e6:.0f} us on average,"
            f" {late.late_s_max * 1e3:.2f} ms at most"
        )
        a, b = sites.topology.sites[0].name, sites.topology.sites[1].name
        size = int(args.bulk_mb * 1e6)
        sites.set_link(a, b, Link(rtt_ms=20, bandwidth_mbit=args.bulk_mbit))
        shaped = bulk(sites, a, b, size)
        sites.set_link(a, b, Link(rtt_ms=20))
        unshaped = bulk(sites, a, b, size)
        for name, cell in (
            (f"shaped {args.bulk_mbit:g} Mbit/s", shaped),
            ("unshaped", unshaped),
        ):
            print(
                f"bulk {args.bulk_mb:g} MB {name}, 20 ms: {cell['seconds']} s,"
                f" {cell['mbit_s']} Mbit/s; router {cell['router_cores']} cores,"
                f" {cell['router_us_per_packet']} us of CPU per packet ({cell['packets']} packets)"
            )
        t2 = time.monotonic()
    torn = time.monotonic() - t2
    print(f"torn down in {torn:.2f} s")
    result.update(
        built_s=round(built, 2),
        torn_down_s=round(torn, 2),
        rtts=rows,
        late_us_mean=round(late.late_s_mean * 1e6),
        late_ms_max=round(late.late_s_max * 1e3, 2),
        shaped=shaped,
        unshaped=unshaped,
        load_average=load,
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
