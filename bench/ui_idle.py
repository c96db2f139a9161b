"""What an open dashboard costs an idle agent: the agent's CPU with no page, then with the page
open on each view in headless Chromium, for ``--seconds`` each.

The mesh: ``--nodes`` agents with simulated engines (no requests sent, so the only work is the
mesh's own gossip and the engines' health and metrics polls), the page on the first one. The
agent process's CPU time is read from /proc (its engine is another process and is not
counted); the figure is the share of one core. The target (issue 25): the page's own requests
add under 1% of an idle agent's CPU.

    python bench/ui_idle.py                      # 3 nodes, 60 s per phase, about 6 minutes
    python bench/ui_idle.py --seconds 20 --views mesh,models

Needs Debian's chromium and chromium-driver (``apt-get install chromium chromium-driver``; the
browser tests install them) and selenium (the test extra).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for path in (REPO, BENCH_DIR):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _procs import cpu_ticks  # noqa: E402

from cli.localmesh import LocalMesh, wait_until  # noqa: E402
from tests.support.browser import console_errors, new_driver  # noqa: E402

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
VIEWS = ("mesh", "models", "node", "controller")


def agent_cpu(page: int, others: list[int], seconds: float) -> tuple[float, float]:
    """CPU over ``seconds`` as a percentage of one core: the page's agent, and the mean of the
    other agents (asked by it for the mesh-wide figures)."""
    before = [cpu_ticks([pid]) for pid in (page, *others)]
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    used = [cpu_ticks([pid]) - b for pid, b in zip((page, *others), before, strict=True)]
    pct = [100.0 * u / TICKS_PER_S / wall for u in used]
    return pct[0], sum(pct[1:]) / max(1, len(pct) - 1)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--views", default="mesh,models,node")
    p.add_argument("--settle-s", type=float, default=10.0, help="idle time before measuring")
    args = p.parse_args(argv)
    views = [v for v in args.views.split(",") if v]
    unknown = sorted(set(views) - set(VIEWS))
    if unknown:
        p.error(f"unknown view {unknown[0]!r} (use {', '.join(VIEWS)})")
    with (
        tempfile.TemporaryDirectory(prefix="fabric-ui-idle-") as work,
        LocalMesh(Path(work)) as mesh,
    ):
        agents = [mesh.start(wait=False, args=["--sim", "llama-3-8b"]) for _ in range(args.nodes)]
        for agent in agents:
            agent.wait_ready(30.0)
        page_agent = agents[0]
        import httpx

        def serving() -> bool:
            nodes = httpx.get(f"{page_agent.http_url}/fabric/v1/nodes", timeout=2).json()["nodes"]
            return sum(n["state"] == "serving" for n in nodes) == args.nodes

        if not wait_until(serving, 40.0):
            print("the mesh did not converge", file=sys.stderr)
            return 1
        time.sleep(args.settle_s)
        others = [a.pid for a in agents[1:]]
        rows = [("no page", agent_cpu(page_agent.pid, others, args.seconds))]
        driver = new_driver()
        try:
            for view in views:
                fragment = view if view != "node" else f"node/{page_agent.session_id}"
                driver.get(f"{page_agent.http_url}/ui#/{fragment}")
                time.sleep(3.0)  # loaded, first answers drawn
                rows.append((f"page on {view}", agent_cpu(page_agent.pid, others, args.seconds)))
            errors = console_errors(driver)
        finally:
            driver.quit()
        rows.append(("no page again", agent_cpu(page_agent.pid, others, args.seconds)))
    idle = (rows[0][1][0] + rows[-1][1][0]) / 2
    idle_others = (rows[0][1][1] + rows[-1][1][1]) / 2
    print(f"agent CPU, % of one core, {args.seconds:g} s per phase, {args.nodes} idle nodes")
    print(f"{'phase':20} {'page agent':>10} {'added':>7} {'others':>7} {'added':>7}")
    for name, (cpu, other) in rows:
        print(f"{name:20} {cpu:10.2f} {cpu - idle:+7.2f} {other:7.2f} {other - idle_others:+7.2f}")
    print(f"browser console errors: {len(errors)}")
    for line in errors:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
