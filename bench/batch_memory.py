"""Memory of real agents while a large batch is finalized and its output downloaded.

A batch whose shards are all answered, with an output of ``--output-mb`` MiB, is written into
the mesh's store in the store's own layout (``tests/support/batchfill.py``: ``--result-kb`` of
answer text per line, every 50th line an error, every 7th answered twice), then published whole
while ``--agents`` agents run (no engines: finalizing and downloading need none). Their
workers race for the ``finalize`` lease; one merges the shards into the output and error files.
The output is then downloaded through one agent's ingress (``GET /v1/files/{id}/content``),
twice at once, and checked byte for byte (SHA-256). Each agent's RSS (``VmRSS``) is sampled
every 20 ms; reported: its baseline, and its peak growth over it while finalizing and while
downloading, with the slowest status poll seen while finalizing.

    python bench/batch_memory.py                       # 512 MiB, 3 agents
    python bench/batch_memory.py --output-mb 64 --agents 2
    python bench/batch_memory.py --source /tmp/old-checkout   # the agents of another checkout

Needs nothing but the repository (no engine, no GPU); ~1.1 GB of disk under the temporary
directory for the 512 MiB case (results and output).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for path in (REPO, BENCH_DIR):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import httpx  # noqa: E402

from cli.localmesh import LocalMesh  # noqa: E402
from tests.support.batchfill import fill_done_batch, publish  # noqa: E402

MIB = 1024 * 1024


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Sampler:
    """Samples the RSS of some processes every ``interval_s``; ``peak()`` since ``mark()``."""

    def __init__(self, pids: list[int], interval_s: float = 0.02) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self._peaks = dict.fromkeys(pids, 0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                for pid in self.pids:
                    self._peaks[pid] = max(self._peaks[pid], rss(pid))

    def mark(self) -> None:
        with self._lock:
            self._peaks = {pid: rss(pid) for pid in self.pids}

    def peak(self) -> dict[int, int]:
        with self._lock:
            return dict(self._peaks)


def download(url: str, into: list[tuple[int, str]]) -> None:
    digest = hashlib.sha256()
    size = 0
    with httpx.Client(timeout=600) as client, client.stream("GET", url) as r:
        r.raise_for_status()
        for piece in r.iter_bytes(MIB):
            digest.update(piece)
            size += len(piece)
    into.append((size, digest.hexdigest()))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--output-mb", type=float, default=512.0, help="size of the output file")
    p.add_argument("--result-kb", type=float, default=32.0, help="answer text per result line")
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--downloads", type=int, default=2, help="concurrent downloads of the output")
    p.add_argument("--source", type=Path, help="run the agents from this checkout's sources")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args(argv)
    result_bytes = int(args.result_kb * 1024)
    # A result line is its answer text and ~250 bytes of JSON; every 50th goes to the error file.
    lines = max(1, int(args.output_mb * MIB / (result_bytes + 250) / 0.98))
    with tempfile.TemporaryDirectory(prefix="batchmem-") as tmp:
        work = Path(tmp)
        mesh = LocalMesh(work / "mesh", log_level="warning", source=args.source)
        with mesh:
            agents = [mesh.start(f"agent{i}") for i in range(args.agents)]
            pids = [a.pid for a in agents]
            t0 = time.monotonic()
            filled = fill_done_batch(work / "staging", lines=lines, result_bytes=result_bytes)
            print(
                f"filled: {lines} lines, output {filled.output_bytes / MIB:.0f} MiB, errors "
                f"{filled.error_bytes / MIB:.1f} MiB, written in {time.monotonic() - t0:.1f} s "
                "(staged, not yet published)"
            )
            time.sleep(2.0)  # the agents settle
            baseline = {pid: rss(pid) for pid in pids}
            front = agents[0].http_url
            batch_url = f"{front}/v1/batches/{filled.batch_id}"
            with Sampler(pids) as sampler, httpx.Client(timeout=600) as client:
                sampler.mark()
                t0 = time.monotonic()
                publish(work / "staging", mesh.workdir / "batches", filled.batch_id)
                slowest_poll = 0.0
                while True:
                    q0 = time.monotonic()
                    record = client.get(batch_url).json()
                    slowest_poll = max(slowest_poll, time.monotonic() - q0)
                    if record["status"] in ("completed", "failed", "expired", "cancelled"):
                        break
                    if time.monotonic() - t0 > 1800:
                        raise SystemExit(f"not finalized in 30 min: {record['status']}")
                    time.sleep(0.2)
                finalize_s = time.monotonic() - t0
                finalize_peak = sampler.peak()
                assert record["status"] == "completed", record
                counts = record["request_counts"]
                assert (counts["completed"], counts["failed"]) == (filled.completed, filled.failed)
                sampler.mark()
                t1 = time.monotonic()
                got: list[tuple[int, str]] = []
                url = f"{front}/v1/files/{record['output_file_id']}/content"
                threads = [
                    threading.Thread(target=download, args=(url, got))
                    for _ in range(args.downloads)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                download_s = time.monotonic() - t1
                download_peak = sampler.peak()
            assert got == [(filled.output_bytes, filled.output_sha256)] * args.downloads, got
    rows = []
    print(
        f"\nfinalized in {finalize_s:.1f} s (slowest status poll {slowest_poll * 1000:.0f} ms); "
        f"{args.downloads} downloads of {filled.output_bytes / MIB:.0f} MiB at once in "
        f"{download_s:.1f} s, byte-identical"
    )
    print(f"{'agent':<8} {'baseline MiB':>13} {'finalize +MiB':>14} {'download +MiB':>14}")
    for i, pid in enumerate(pids):
        grow_f = (finalize_peak[pid] - baseline[pid]) / MIB
        grow_d = (download_peak[pid] - baseline[pid]) / MIB
        rows.append(
            {"agent": i, "baseline_mib": baseline[pid] / MIB, "finalize_growth_mib": grow_f,
             "download_growth_mib": grow_d}
        )  # fmt: skip
        print(f"agent{i:<3} {baseline[pid] / MIB:>13.0f} {grow_f:>14.0f} {grow_d:>14.0f}")
    worst = max(max(r["finalize_growth_mib"], r["download_growth_mib"]) for r in rows)
    print(f"largest growth of any agent: {worst:.0f} MiB (agent0 served the downloads)")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"output_bytes": filled.output_bytes, "finalize_s": finalize_s,
                 "download_s": download_s, "slowest_poll_s": slowest_poll,
                 "agents": rows, "largest_growth_mib": worst},
                indent=2,
            )
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
