"""A/B of the data plane: this checkout's agent against another revision's, side by side.

Day-to-day host noise moves every router's CPU per request by ±25% between runs of
bench/router.py, far more than most changes to the data plane. Within one run, two agents
measured in alternating short cells see the same host: this bench starts one serving agent
from this checkout (B) and one from ``--baseline REV`` (A, a git worktree of that revision,
its data plane compiled as this one's is), each supervising its own fast fake backend, and
drives them in turns with the same closed-loop load (bench/_loadgen.py; the order flips every
pair). Reported per agent: throughput and agent CPU per request (user and system time from
/proc), medians over the pairs, and B/A per pair.

    python bench/router_ab.py --baseline HEAD~1                # c=32 json, 8 pairs
    python bench/router_ab.py --baseline main --concurrency 1 --stream --pairs 12

The worktree lives in a temporary directory and is removed at exit; ``--baseline-dir DIR``
uses an existing checkout instead (built in place when its native build is stale).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _procs import free_port
from router import MODEL, models_listed, wait_until

from cli.localmesh import LocalMesh

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent


@contextlib.contextmanager
def checkout(rev: str | None, directory: str | None) -> Iterator[Path]:
    """The baseline's source tree: ``directory`` as it is, or a worktree of ``rev``."""
    if directory:
        yield Path(directory).resolve()
        return
    assert rev is not None
    tmp = Path(tempfile.mkdtemp(prefix="fabric-ab-"))
    tree = tmp / "baseline"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev],
        check=True,
        capture_output=True,
    )
    try:
        yield tree
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
            capture_output=True,
        )
        shutil.rmtree(tmp, ignore_errors=True)


def build_native(tree: Path) -> str:
    """Compile ``tree``'s data plane when the current interpreter's native build is in use."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if os.environ.get("FABRIC_NATIVE") == "0":
        return "interpreted (FABRIC_NATIVE=0)"
    out = subprocess.run(
        [sys.executable, "-m", "fabricnode.native_build", "build"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"router_ab: native build of {tree} failed:\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "built"


def start_agent(tree: Path, workdir: Path, name: str) -> tuple[LocalMesh, Any, int]:
    """One serving agent run from ``tree`` (its cwd and PYTHONPATH), with a fake backend."""
    saved_cwd, saved_env = os.getcwd(), dict(os.environ)
    os.chdir(tree)  # ``python -m cli.main`` imports from the working directory first
    os.environ["PYTHONPATH"] = str(tree)
    try:
        mesh = LocalMesh(workdir / name, provider="ab", log_level="warning")
        port = free_port()
        backend = [sys.executable, str(BENCH_DIR / "fake_backend.py"), "--port", str(port)]
        agent = mesh.start(
            name,
            args=["--engine-url", f"http://127.0.0.1:{port}", "--", *backend, "--model", MODEL],
            timeout_s=30.0,
        )
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return mesh, agent, int(agent.http_url.rsplit(":", 1)[1])


def cpu_ticks(pid: int) -> tuple[int, int]:
    """(utime, stime) of one process, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="HEAD", help="git revision for A (default HEAD)")
    p.add_argument("--baseline-dir", help="an existing checkout for A instead of a worktree")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--seconds", type=float, default=2.0, help="recorded seconds per cell")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--stream", action="store_true", help="SSE instead of JSON responses")
    p.add_argument("--prompt-bytes", type=int, default=2000)
    args = p.parse_args()

    with checkout(args.baseline, args.baseline_dir) as tree, tempfile.TemporaryDirectory() as wd:
        print(f"[ab] A = {args.baseline_dir or args.baseline}: {build_native(tree)}", flush=True)
        print(f"[ab] B = this checkout: {build_native(REPO)}", flush=True)
        agents = {}
        meshes = []
        try:
            for label, source in (("A", tree), ("B", REPO)):
                mesh, agent, port = start_agent(source, Path(wd), f"agent{label}")
                meshes.append(mesh)
                wait_until(lambda port=port: models_listed(port), 30.0, f"agent{label}")
                agents[label] = (agent.pid, port)
            loadgen = subprocess.Popen(
                [sys.executable, str(BENCH_DIR / "_loadgen.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert loadgen.stdin is not None and loadgen.stdout is not None
            rows: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
            for pair in range(args.pairs):
                for label in ("A", "B") if pair % 2 == 0 else ("B", "A"):
                    pid, port = agents[label]
                    spec = {
                        "host": "127.0.0.1",
                        "port": port,
                        "path": "/v1/chat/completions",
                        "model": MODEL,
                        "stream": args.stream,
                        "concurrency": args.concurrency,
                        "warmup_s": 0.3,
                        "seconds": args.seconds,
                        "prompt_bytes": args.prompt_bytes,
                        "drain_s": 2.0,
                        "cpu_groups": {"agent": [pid]},
                    }
                    u0, s0 = cpu_ticks(pid)
                    loadgen.stdin.write(json.dumps(spec) + "\n")
                    loadgen.stdin.flush()
                    res = json.loads(loadgen.stdout.readline())
                    u1, s1 = cpu_ticks(pid)
                    done = max(1, res["completed"])
                    cpu_s = sum(res["cpu_ticks"].values()) / res["clk_tck"]
                    # /proc's split covers the whole cell (warm-up and drain too): its ratio
                    # splits the recorded window's CPU.
                    user_share = (u1 - u0) / max(1, (u1 - u0) + (s1 - s0))
                    rows[label].append(
                        {
                            "rps": res["completed"] / res["window_s"],
                            "cpu_us": 1e6 * cpu_s / done,
                            "user_us": 1e6 * cpu_s * user_share / done,
                            "errors": res["errors"],
                        }
                    )
                    print(
                        f"[ab] pair {pair + 1}/{args.pairs} {label}: "
                        f"{rows[label][-1]['rps']:.0f} req/s, "
                        f"{rows[label][-1]['cpu_us']:.1f} us CPU/req",
                        flush=True,
                    )
            loadgen.terminate()
        finally:
            for mesh in meshes:
                with contextlib.suppress(Exception):
                    mesh.stop_all(timeout_s=5.0)
                mesh.close()

    mode = "sse" if args.stream else "json"
    print(f"\nrouter_ab: c={args.concurrency} {mode}, {args.pairs} pairs x {args.seconds:g} s")
    for label in ("A", "B"):
        r = rows[label]
        print(
            f"{label}: req/s {statistics.median(x['rps'] for x in r):8.0f}   "
            f"CPU us/req {statistics.median(x['cpu_us'] for x in r):6.1f}   "
            f"user {statistics.median(x['user_us'] for x in r):6.1f}   "
            f"errors {sum(int(x['errors']) for x in r)}"
        )
    tput = [b["rps"] / a["rps"] for a, b in zip(rows["A"], rows["B"], strict=True)]
    cpu = [b["cpu_us"] / a["cpu_us"] for a, b in zip(rows["A"], rows["B"], strict=True)]
    print(f"B/A throughput per pair: {' '.join(f'{x:.2f}' for x in tput)}")
    print(
        f"B/A medians: throughput {statistics.median(tput):.3f}, "
        f"CPU per request {statistics.median(cpu):.3f}"
    )


if __name__ == "__main__":
    main()
