"""What federating sites costs on the WAN and at a gateway: the bytes a gateway sends and
receives at steady state, and the CPU it spends building and signing its site's summary, with
the real summary code (``fabricnode.federation``) over a registry of simulated nodes.

Sites exchange signed summaries, never entries (docs/federation.md): a summary's size grows
with the models a site serves, not with its nodes. This bench shows both halves of that claim
at the issue's scale (5 sites x 2,000 nodes):

* the encoded summary and its frame for 10 to 512 models, and a gateway's WAN bytes per second
  to and from its peer sites (every summary re-signed each keep-alive, pings each second, TLS
  records and TCP/IP headers counted), at steady state and at worst (every summary changing
  every second);
* the CPU a gateway spends per summary (``capacity_of`` over its registry, ``body_of``, the
  Ed25519 signature) at 200 to 8,000 nodes, once a second.

    python bench/federation_bytes.py                    # 5 sites, 2,000 nodes a site, 40 models
    python bench/federation_bytes.py --sites 8 --nodes 4000 --models 142 --json out.json
    python bench/federation_bytes.py --quick            # a smoke run (tests/system)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fabricnode.federation.keygen import generate_site_key  # noqa: E402
from fabricnode.federation.protocol import Ping, Pong, Summary, encode  # noqa: E402
from fabricnode.federation.settings import FederationConfig  # noqa: E402
from fabricnode.federation.summary import (  # noqa: E402
    ModelCapacity,
    SiteSummary,
    body_of,
    capacity_of,
    gateways_of,
)
from fabricnode.mesh.core import MeshCore  # noqa: E402
from fabricnode.mesh.identity import Identity  # noqa: E402
from fabricnode.mesh.keyring import Keyring  # noqa: E402
from fabricnode.mesh.registry import ModelInfo, State  # noqa: E402
from fabricnode.mesh.wire import Load  # noqa: E402
from fabricnode.testing.simnet import make_body  # noqa: E402

NOW = 1_800_000_000.0
# TLS 1.3 application record: 5-byte header, 1-byte inner content type, 16-byte AEAD tag; one
# record and one TCP segment per frame (frames are far below a record's 16 KiB), IPv4 + TCP
# headers with timestamps: 52 bytes. ACKs ride back on the peer's own frames or are delayed;
# counted as one bare 52-byte segment per frame received, the worst case.
TLS_RECORD_OVERHEAD = 22
TCP_IP_OVERHEAD = 52


def model_names(count: int) -> list[str]:
    """Names shaped like what researchers serve (an org, a model, a size, a variant)."""
    orgs = ["meta-llama", "Qwen", "mistralai", "google", "deepseek-ai", "microsoft", "allenai"]
    out = []
    for i in range(count):
        org = orgs[i % len(orgs)]
        out.append(f"{org}/Model-{i:03d}-{(i * 7) % 72 + 1}B-Instruct-v{i % 4}")
    return out


def summary_for(key_dir: Path, site: str, models: int, gateways: int) -> SiteSummary:
    key = generate_site_key(site, key_dir)
    caps = {
        name: ModelCapacity(3 + i % 17, (1 + i % 5) % 4, i % 40, 1000 * (i % 9), (i % 100) / 100)
        for i, name in enumerate(model_names(models))
    }
    addrs = [f"gw{i}.{site.lower()}.example.org:7950" for i in range(gateways)]
    return SiteSummary.sign(body_of(site, 1, NOW, addrs, caps), key)


def wire_bytes(frame: int) -> int:
    return frame + TLS_RECORD_OVERHEAD + TCP_IP_OVERHEAD


def wan_rates(summary_frame: int, peers: int, cfg: FederationConfig) -> dict[str, float]:
    """Bytes per second a gateway sends and receives on the WAN: its summary to every peer and
    every peer's to it, each at least every keep-alive (steady) or every summary period
    (worst: something changes every period), and a ping and a pong each way per link each
    ping interval (links counted once: one connection a pair carries the summaries)."""
    ping = wire_bytes(len(encode(Ping(2**40))))
    pong = wire_bytes(len(encode(Pong(2**40))))
    ack = TCP_IP_OVERHEAD
    pings = peers * 2 * (ping + pong + 2 * ack) / cfg.ping_interval_s
    summary = wire_bytes(summary_frame) + ack
    steady = 2 * peers * summary / cfg.keepalive_s + pings
    worst = 2 * peers * summary / cfg.summary_period_s + pings
    return {"steady_bytes_s": steady, "worst_bytes_s": worst}


def registry(nodes: int, models: int, site: str, seed: int) -> MeshCore:
    """A gateway's registry: ``nodes`` SERVING entries of ``site`` (signed), each serving one
    of ``models`` (Zipf-like popularity), with fresh load reports; a tenth of another site."""
    rng = random.Random(seed)
    me = Identity.from_seed(f"gw-{site}".encode())
    core = MeshCore(me, Keyring.with_key(b"k" * 32), make_body(me, "10.0.0.1:7946", NOW), NOW)
    names = model_names(models)
    weights = [1 / (i + 1) ** 1.2 for i in range(models)]
    for i in range(nodes):
        ident = Identity.from_seed(f"{site}-{seed}-{i}".encode())
        addr = f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}:7946"
        model = rng.choices(names, weights)[0]
        where = site if i % 10 else "other"
        entry = make_body(
            ident, addr, NOW, state=State.SERVING, models=(ModelInfo(model, 8192, None),),
            site=where,
        ).sign(ident)  # fmt: skip
        core.registry.merge(entry, NOW)
        core.members.learn_address(entry.session_id, addr, NOW)
        core.loads[entry.session_id] = Load(
            entry.session_id, 1, rng.randrange(3), rng.randrange(8), rng.random(), 0, NOW
        )  # seq, waiting, running, kv_usage, inflight, at
    return core


def summary_cpu(core: MeshCore, key_dir: Path, site: str, rounds: int) -> dict[str, float]:
    key = generate_site_key(site, key_dir)
    started = time.process_time()
    size = 0
    for r in range(rounds):
        caps = capacity_of(core, site, NOW)
        gws = gateways_of(core, site, "gw0.example.org:7950")
        size = len(SiteSummary.sign(body_of(site, r + 1, NOW, gws, caps), key).encode())
    per = (time.process_time() - started) / rounds
    return {"cpu_ms_per_summary": per * 1e3, "summary_bytes": size, "models": len(caps)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sites", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=2000, help="nodes per site")
    ap.add_argument("--models", type=int, default=40, help="models a site serves")
    ap.add_argument("--gateways", type=int, default=2, help="gateways per site")
    ap.add_argument("--rounds", type=int, default=20, help="summaries built per registry size")
    ap.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.rounds = 200, 3
    cfg = FederationConfig(
        gateway="gw0.example.org:7950", listen_host="0.0.0.0", listen_port=7950,
        site_key_path=Path("unused"), peer_sites_dir=Path("unused"),
    )  # fmt: skip
    peers = args.sites - 1
    out: dict[str, object] = {"sites": args.sites, "nodes_per_site": args.nodes}
    print(f"bench/federation: {args.sites} sites, {args.gateways} gateways a site, keep-alive "
          f"{cfg.keepalive_s:g} s, summaries every {cfg.summary_period_s:g} s at most, pings "
          f"every {cfg.ping_interval_s:g} s")  # fmt: skip
    print("\nthe summary and a gateway's WAN traffic, by models served (independent of nodes):")
    print(f"{'models':>7} {'summary B':>10} {'frame B':>8} {'steady KB/s':>12} {'worst KB/s':>11}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for models in sorted({10, args.models, 142, 512}):
            s = summary_for(Path(tmp) / f"k{models}", "C", models, args.gateways)
            frame = len(encode(Summary(s.encode())))
            rates = wan_rates(frame, peers, cfg)
            row = {"models": models, "summary_bytes": len(s.encode()), "frame_bytes": frame,
                   **rates}  # fmt: skip
            rows.append(row)
            steady, worst = rates["steady_bytes_s"] / 1e3, rates["worst_bytes_s"] / 1e3
            print(f"{models:>7} {len(s.encode()):>10} {frame:>8} {steady:>12.2f} {worst:>11.2f}")
        out["wan"] = rows
        print("\nbuilding and signing our summary, by the gateway's registry size "
              f"({args.models} models, a tenth of the nodes of another site):")  # fmt: skip
        print(f"{'nodes':>7} {'ms CPU':>8} {'summary B':>10}")
        cpu_rows = []
        sizes = [args.nodes] if args.quick else sorted({200, 2000, args.nodes, 8000})
        for nodes in sizes:
            core = registry(nodes, args.models, "C", seed=nodes)
            row = {"nodes": nodes, **summary_cpu(core, Path(tmp) / f"c{nodes}", "C", args.rounds)}
            cpu_rows.append(row)
            print(f"{nodes:>7} {row['cpu_ms_per_summary']:>8.2f} {row['summary_bytes']:>10}")
        out["cpu"] = cpu_rows
    target = next(r for r in rows if r["models"] == args.models)
    steady_kb = float(target["steady_bytes_s"]) / 1e3
    worst_kb = float(target["worst_bytes_s"]) / 1e3
    verdict = "MET" if worst_kb <= 50 else "MISSED"
    print(f"\ntarget: <= 50 KB/s per gateway at steady state ({args.sites} sites, "
          f"{args.models} models): {steady_kb:.2f} KB/s steady, {worst_kb:.2f} KB/s at worst "
          f"(every summary changing every period): {verdict}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
