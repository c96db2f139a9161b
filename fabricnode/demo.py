"""``fabric demo``: a real mesh on this machine, shown step by step in plain lines.

It runs N real ``fabric start`` processes (127.0.0.1, free ports, a fresh cluster key and
rendezvous file in a temporary ``FABRIC_HOME``) and, polling every agent's admin API:

1. shows the registry converge (how many entries each agent sees) and the simulated engines
   turn SERVING;
2. sends real chat requests through every agent (any agent is an ingress) and shows which node
   served each one;
3. SIGKILLs a node whose model another node also serves, sends requests for that model at once
   (they fail over, invisibly to the client) and shows the survivors' failure detectors declare
   it dead (no one can sign a crashed node's death but its accusers: suspect first, then dead);
4. SIGTERMs another and shows its signed LEFT reach every other agent;
5. stops the rest gracefully.

Every process is reaped on the way out, on success, error or Ctrl-C (``LocalMesh``). The temporary
directory is removed on success and kept, with each agent's log, when something went wrong.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from fabricnode.client import AdminClient
from fabricnode.errors import AgentApiError, FabricError
from fabricnode.localmesh import AgentProcess, LocalMesh
from fabricnode.views import Json

CONVERGE_TIMEOUT_S = 20.0
LEAVE_TIMEOUT_S = 10.0
DEAD_TIMEOUT_S = 20.0
POLL_INTERVAL_S = 0.2

View = dict[str, Json] | None  # session id -> entry, as one agent sees it (None: no answer)


class Demo:
    def __init__(self, mesh: LocalMesh, nodes: int, say: Callable[[str], None]) -> None:
        self.mesh = mesh
        self.nodes = nodes
        self.say = say
        self.t0 = time.monotonic()

    def stamp(self) -> str:
        return f"{time.monotonic() - self.t0:5.1f}s"

    def view(self, agent: AgentProcess) -> View:
        try:
            with AdminClient(agent.http_url, timeout_s=1.0) as client:
                return {n["session_id"]: n for n in client.nodes()}
        except AgentApiError:
            return None

    def watch(
        self,
        watchers: list[AgentProcess],
        describe: Callable[[View], str],
        done: Callable[[View], bool],
        timeout_s: float,
        what: str,
    ) -> None:
        """Print each watcher's ``describe`` whenever it changes, until all are ``done``."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while True:
            views = [self.view(a) for a in watchers]
            pairs = zip(watchers, views, strict=True)
            line = "  ".join(f"{a.name}: {describe(v)}" for a, v in pairs)
            if line != last:
                self.say(f"  {self.stamp()}  {line}")
                last = line
            if all(done(v) for v in views):
                return
            if time.monotonic() > deadline:
                raise FabricError(f"{what} did not happen within {timeout_s:g} s")
            time.sleep(POLL_INTERVAL_S)

    def request(self, ingress: AgentProcess, model: str, names: dict[str, str]) -> None:
        """One chat request through ``ingress``; prints who served it and the answer."""
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Say something about HPC."}],
            "max_tokens": 6,
        }
        t0 = time.monotonic()
        try:
            r = httpx.post(ingress.http_url + "/v1/chat/completions", json=body, timeout=30)
        except httpx.HTTPError as exc:
            raise FabricError(f"request through {ingress.name} failed: {exc}") from None
        ms = (time.monotonic() - t0) * 1000
        if r.status_code != 200:
            raise FabricError(f"request through {ingress.name} answered {r.status_code}: {r.text}")
        served = names.get(r.headers.get("x-fabric-node", ""), "?")
        text = r.json()["choices"][0]["message"]["content"].strip()
        self.say(
            f"  via {ingress.name:6} {model:11} -> served by {served:18} {ms:5.0f} ms  {text!r}"
        )

    def run(self) -> None:
        n = self.nodes
        self.say(f"Starting {n} agents on 127.0.0.1 (key and rendezvous in {self.mesh.workdir})")
        agents = [
            self.mesh.start(wait=False, args=["--sim", model, "--sim-gpu", gpu])
            for model, gpu in (DEMO_FLEET[i % len(DEMO_FLEET)] for i in range(n))
        ]
        for a in agents:
            a.wait_ready(30.0)
        for a in agents:
            self.say(
                f"  {a.name}  session {a.session_id[:8]}  http {a.http_url}  gossip {a.gossip_addr}"
            )

        self.say(f"\n1. Registry converging: entries each agent sees (of {n})")
        self.watch(
            agents,
            lambda v: "?" if v is None else f"{len(v)}",
            lambda v: (
                v is not None and len(v) == n and all(e["liveness"] == "alive" for e in v.values())
            ),
            CONVERGE_TIMEOUT_S,
            "convergence",
        )
        self.say(f"  every agent sees all {n} entries, all alive")

        self.say("\n   Simulated engines loading; each node turns SERVING with its model and GPUs")
        self.watch(
            agents[:1],
            lambda v: "?" if v is None else " ".join(_serving(e) for e in v.values()),
            lambda v: v is not None and all(e["state"] == "serving" for e in v.values()),
            CONVERGE_TIMEOUT_S,
            "engines serving",
        )

        fleet = {a.name: DEMO_FLEET[i % len(DEMO_FLEET)] for i, a in enumerate(agents)}
        names = {a.session_id: f"{a.name} ({fleet[a.name][1].split(':')[0]})" for a in agents}
        models = sorted({m for m, _ in fleet.values()})
        self.say("\n2. Requests through every agent (each one is an OpenAI endpoint)")
        for ingress in agents:
            for model in models:
                self.request(ingress, model, names)

        # The victim's model must be served by someone else, so its requests can fail over.
        victim = agents[1]
        leaver = next(a for a in agents[2:])
        rest = [a for a in agents if a not in (victim, leaver)]
        sid = victim.session_id
        model = fleet[victim.name][0]
        self.say(f"\n3. kill -9 {victim.name} ({sid[:8]}): a crash; requests for {model} go on")
        victim.kill()
        # Through an agent that does not serve the model itself: the answer comes from a peer.
        via = next((a for a in rest if fleet[a.name][0] != model), rest[0])
        for _ in range(3):
            self.request(via, model, names)
        self.watch(
            rest,
            lambda v: _liveness_of(v, sid),
            lambda v: v is not None and sid in v and v[sid]["liveness"] == "dead",
            DEAD_TIMEOUT_S,
            f"{victim.name}'s death being detected",
        )
        self.say(f"  {victim.name} is dead in every survivor's view")

        sid = leaver.session_id
        self.say(f"\n4. SIGTERM {leaver.name} ({sid[:8]}): it signs LEFT, gossips it, exits")
        leaver.terminate()
        self.watch(
            rest,
            lambda v: _state_of(v, sid),
            lambda v: v is not None and sid in v and v[sid]["state"] == "left",
            LEAVE_TIMEOUT_S,
            f"{leaver.name}'s LEFT spreading",
        )
        code = _exit_code(leaver)
        self.say(f"  {leaver.name} is LEFT everywhere; it exited with status {code}")

        self.say(f"\n5. Stopping the remaining {len(rest)} agents (SIGTERM)")
        codes = self.mesh.stop_all()
        self.say("  " + "  ".join(f"{a.name}: exit {codes[a.name]}" for a in rest))
        self.say(f"\nDone in {time.monotonic() - self.t0:.1f} s.")


# (model, simulated GPU) per node, cycled: two models on mixed GPU types.
DEMO_FLEET = [
    ("llama-3-8b", "H100:2"),
    ("llama-3-8b", "A100-80G"),
    ("qwen2.5-7b", "L40S"),
    ("qwen2.5-7b", "RTX-3090:2"),
]


def _serving(entry: dict[str, Any]) -> str:
    hw = entry["hardware"]
    models = ",".join(m["id"] for m in entry["models"]) or "-"
    return f"[{entry['state']} {models} {hw['gpu_count']}x{hw['gpu_type'] or '?'}]"


def _state_of(view: View, sid: str) -> str:
    if view is None:
        return "?"
    entry = view.get(sid)
    return "absent" if entry is None else f"{entry['state']}/{entry['liveness']}"


def _liveness_of(view: View, sid: str) -> str:
    if view is None:
        return "?"
    entry = view.get(sid)
    return "absent" if entry is None else str(entry["liveness"])


def _exit_code(agent: AgentProcess) -> int | str:
    try:
        return agent.wait(10.0)
    except subprocess.TimeoutExpired:
        return "still running"


def run_demo(nodes: int = 4, *, say: Callable[[str], None] | None = None) -> int:
    """Run the demo; returns the exit status. FabricError (kept logs named) if a step fails."""
    if nodes < 3:
        raise FabricError("the demo needs at least 3 nodes (one leaves, one crashes)")
    out = say or _say
    workdir = Path(tempfile.mkdtemp(prefix="fabric-demo-"))
    ok = False
    try:
        with LocalMesh(workdir, provider="demo") as mesh:
            Demo(mesh, nodes, out).run()
        ok = True
        return 0
    except KeyboardInterrupt:
        out("\ninterrupted: every agent was stopped")
        ok = True
        return 130
    except FabricError as exc:
        raise FabricError(f"demo failed: {exc} (agent logs kept in {workdir})") from exc
    finally:
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)


def _say(line: str) -> None:
    print(line, flush=True)
    sys.stdout.flush()
