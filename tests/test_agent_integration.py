"""Real `fabric start` processes on 127.0.0.1: convergence, crash detection, graceful leave, live
key rotation, and the demo. Every process is killed and reaped even when a test fails."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from cli.main import app
from fabricnode.client import AdminClient
from fabricnode.errors import AgentApiError
from fabricnode.keyring import Keyring
from fabricnode.localmesh import AgentProcess, LocalMesh
from fabricnode.rendezvous import announce

pytestmark = pytest.mark.slow

CONVERGE_S = 30.0
DEAD_WITHIN_S = 15.0
LEFT_WITHIN_S = 10.0

View = dict[str, dict[str, Any]]


def view(agent: AgentProcess) -> View | None:
    try:
        with AdminClient(agent.http_url, timeout_s=2.0) as client:
            return {n["session_id"]: n for n in client.nodes()}
    except AgentApiError:
        return None


def wait_for(
    watchers: list[AgentProcess],
    done: Callable[[View], bool],
    timeout_s: float,
    what: str,
) -> float:
    """Poll every watcher's registry view until ``done`` holds for all; returns seconds taken."""
    start = time.monotonic()
    views: list[View | None] = []
    while time.monotonic() - start < timeout_s:
        views = [view(a) for a in watchers]
        if all(v is not None and done(v) for v in views):
            return time.monotonic() - start
        time.sleep(0.2)
    summary = {
        a.name: None
        if v is None
        else {sid[:8]: (e["state"], e["liveness"]) for sid, e in v.items()}
        for a, v in zip(watchers, views, strict=True)
    }
    raise AssertionError(f"{what} not within {timeout_s:g} s; views: {summary}")


def all_alive(count: int) -> Callable[[View], bool]:
    return lambda v: (
        len(v) == count
        and all(e["liveness"] == "alive" and e["state"] == "join" for e in v.values())
    )


def metric(agent: AgentProcess, name: str) -> float:
    text = httpx.get(f"{agent.http_url}/metrics", timeout=2.0).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_five_agents_converge_detect_a_crash_and_see_a_leave(mesh: LocalMesh) -> None:
    agents = mesh.start_many(5)
    assert len({a.session_id for a in agents}) == 5
    wait_for(agents, all_alive(5), CONVERGE_S, "all 5 agents seeing 5 alive entries")
    for a in agents:
        assert httpx.get(f"{a.http_url}/ready", timeout=2.0).status_code == 200

    crashed = agents[4]
    crashed.kill()
    took = wait_for(
        agents[:4],
        lambda v: v[crashed.session_id]["liveness"] == "dead",
        DEAD_WITHIN_S,
        f"{crashed.name} (kill -9) reported dead by every other agent",
    )
    print(f"crash detected everywhere in {took:.1f} s")

    leaver = agents[3]
    leaver.terminate()
    assert leaver.wait(LEFT_WITHIN_S) == 0
    wait_for(
        agents[:3],
        lambda v: (
            v[leaver.session_id]["state"] == "left" and v[leaver.session_id]["liveness"] == "left"
        ),
        LEFT_WITHIN_S,
        f"{leaver.name} (SIGTERM) being LEFT in every remaining agent",
    )
    survivors = {a.session_id for a in agents[:3]}
    for v in (view(a) for a in agents[:3]):
        assert v is not None
        assert all(v[sid]["liveness"] == "alive" for sid in survivors)


class DeathWatch:
    """Polls agents in the background and records any member seen dead or left."""

    def __init__(self, agents: list[AgentProcess]) -> None:
        self.agents = agents
        self.bad: list[str] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DeathWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            for agent in self.agents:
                v = view(agent)
                if v is None:
                    self.bad.append(f"{agent.name} did not answer")
                    continue
                for sid, e in v.items():
                    if e["liveness"] in ("dead", "left"):
                        self.bad.append(f"{agent.name} sees {sid[:8]} {e['liveness']}")
            self.polls += 1
            self._stop.wait(0.3)


def test_key_rotation_while_running_keeps_the_mesh_whole(mesh: LocalMesh, tmp_path: Path) -> None:
    agents = mesh.start_many(5)
    wait_for(agents, all_alive(5), CONVERGE_S, "all 5 agents seeing 5 alive entries")
    key = str(mesh.key_path)
    old = Keyring.load(mesh.key_path).primary.hex()
    old_only = tmp_path / "old-only.key"
    old_only.write_bytes(mesh.key_path.read_bytes())
    runner = CliRunner()
    settle_s = 3.0  # agents notice a keyring edit within keyring_poll_s (1 s)

    with DeathWatch(agents) as watch:
        added = runner.invoke(app, ["keys", "add", "--cluster-key", key])
        assert added.exit_code == 0, added.output
        new = added.stdout.strip()
        time.sleep(settle_s)
        assert runner.invoke(app, ["keys", "use", new, "--cluster-key", key]).exit_code == 0
        time.sleep(settle_s)
        assert runner.invoke(app, ["keys", "remove", old, "--cluster-key", key]).exit_code == 0
        time.sleep(settle_s)
    assert watch.polls >= 5
    assert watch.bad == [], watch.bad
    for a in agents:
        assert metric(a, "fabric_keyring_reloads_total") == 3
        assert metric(a, "fabric_cluster_keys") == 1

    new_only = tmp_path / "new-only.key"
    new_only.write_bytes(mesh.key_path.read_bytes())
    assert Keyring.load(new_only).key_ids() == [new]
    sixth = mesh.start("node6", cluster_key=new_only)
    everyone = [*agents, sixth]
    wait_for(everyone, all_alive(6), CONVERGE_S, "all 6 agents seeing 6 alive entries")

    # An agent holding only the removed key cannot get in, nor be seen.
    outsider = mesh.start("outsider", cluster_key=old_only)
    time.sleep(4.0)
    outsider_view = view(outsider)
    assert outsider_view is not None and list(outsider_view) == [outsider.session_id]
    for v in (view(a) for a in everyone):
        assert v is not None and outsider.session_id not in v and len(v) == 6


def test_an_isolated_agent_finds_later_peers_in_the_rendezvous_file(
    mesh: LocalMesh, tmp_path: Path
) -> None:
    first = mesh.start("first")  # alone: nobody to join, so it polls the rendezvous file
    # The second agent announces itself elsewhere and is given no seed: only the first agent's
    # periodic re-read of its rendezvous file can bring them together.
    second = mesh.start("second", args=["--rendezvous", str(tmp_path / "elsewhere")])
    time.sleep(1.0)
    assert view(first) is not None and len(view(first) or {}) == 1
    announce(mesh.rendezvous_path, second.gossip_addr, second.session_id)
    wait_for([first, second], all_alive(2), 15.0, "the two agents finding each other")


def test_join_flag_alone_is_enough_to_join(mesh: LocalMesh) -> None:
    first = mesh.start("first", args=["--rendezvous", ""])
    second = mesh.start("second", args=["--rendezvous", "", "--join", first.gossip_addr])
    wait_for([first, second], all_alive(2), 15.0, "--join bringing the agents together")
    assert not mesh.rendezvous_path.exists(), "no rendezvous file when it is disabled"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_makes_the_agent_leave_and_exit_0(mesh: LocalMesh, signum: int) -> None:
    agent = mesh.start()
    assert httpx.get(f"{agent.http_url}/health", timeout=2.0).status_code == 200
    started = time.monotonic()
    agent.signal(signum)
    assert agent.wait(10.0) == 0
    assert time.monotonic() - started < 6.0
    log = agent.stderr_tail(50)
    assert "leaving" in log and "left the mesh" in log
    assert "Traceback" not in log
    out = agent.stdout_path.read_text().splitlines()
    assert [line.split()[1] for line in out] == ["session", "http", "gossip"]


def test_the_ready_lines_name_reachable_addresses(mesh: LocalMesh) -> None:
    agent = mesh.start(args=["--admin", "127.0.0.1:0"])
    addrs = agent.addrs
    assert addrs is not None and addrs.admin_url
    assert re.fullmatch(r"[0-9a-f]{32}", addrs.session_id)
    assert re.fullmatch(r"127\.0\.0\.1:\d+", addrs.gossip_addr)
    own = httpx.get(f"{addrs.admin_url}/fabric/v1/self", timeout=2.0).json()
    assert own["session_id"] == addrs.session_id
    assert own["addresses"] == {"http": addrs.http_url, "gossip": addrs.gossip_addr}
    # With --admin, the public port keeps only health and readiness.
    assert httpx.get(f"{addrs.http_url}/health", timeout=2.0).status_code == 200
    assert httpx.get(f"{addrs.http_url}/fabric/v1/self", timeout=2.0).status_code == 404


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def _run_demo(*, interrupt_after: str | None = None) -> tuple[int, str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "demo", "--nodes", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if interrupt_after and interrupt_after in line:
                proc.send_signal(signal.SIGINT)
        code = proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, "".join(lines), time.monotonic() - started


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to look for leftovers")
def test_demo_runs_to_completion_and_leaves_no_process_behind() -> None:
    engines_before = set(_processes_mentioning("fabricnode.simengine"))
    code, output, took = _run_demo()
    assert code == 0, output
    assert "every agent sees all 3 entries" in output
    assert "[serving llama-3-8b 2xH100]" in output  # simulated engines on mixed GPUs
    assert "[serving qwen2.5-7b 1xL40S]" in output
    assert "is LEFT everywhere; it exited with status 0" in output
    assert "is dead in every survivor's view" in output
    # Real requests through every agent, each answer naming the node that served it; after the
    # crash the victim's model is still answered (by the other node serving it).
    served = re.findall(r"via (node\d) +(\S+) +-> served by (node\d)", output)
    assert {via for via, _, _ in served} == {"node1", "node2", "node3"}, output
    after_crash = output.split("3. kill -9")[1].split("is dead in every")[0]
    assert len(re.findall(r"served by node1 ", after_crash)) == 3, output
    assert "Done in" in output
    assert took < 60, output
    workdir = re.search(r"(/\S*fabric-demo-\w+)", output)
    assert workdir, output
    assert _processes_mentioning(workdir.group(1)) == []
    time.sleep(0.5)
    leftover = set(_processes_mentioning("fabricnode.simengine")) - engines_before
    assert not leftover, "simulated engines outlived the demo"
    assert not Path(workdir.group(1)).exists(), "the temporary FABRIC_HOME is removed"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to look for leftovers")
def test_interrupted_demo_stops_every_agent() -> None:
    code, output, _ = _run_demo(interrupt_after="1. Registry converging")
    assert code == 130, output
    workdir = re.search(r"(/\S*fabric-demo-\w+)", output)
    assert workdir, output
    time.sleep(0.5)
    assert _processes_mentioning(workdir.group(1)) == []
