"""Real `fabric start` processes on 127.0.0.1: convergence, crash detection, graceful leave, live
key rotation, and the demo. Every process is killed and reaped even when a test fails."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from cli.localmesh import AgentProcess, LocalMesh
from cli.main import app
from fabricnode.control.client import AdminClient
from fabricnode.errors import AgentApiError
from fabricnode.host.rendezvous import announce
from fabricnode.mesh.keyring import Keyring

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


def _demo_processes(workdir: str) -> list[int]:
    """Live processes of one demo: its agents (their command line names the work directory) and
    their engines (they inherit ``FABRIC_HOME=<work directory>``). Other work on the machine,
    agents and engines included, is not counted."""
    home = f"FABRIC_HOME={workdir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if workdir.encode() in cmdline or home in environ:
            found.append(int(entry.name))
    return found


class DemoRun:
    """``fabric demo ARGS`` as a subprocess whose output (not a terminal: plain lines) is read by
    a thread, so a test can wait for a line with a timeout. ``close`` kills it if still running."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "demo", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def _next(self, deadline: float, what: str) -> str | None:
        """The next line (None at the end of the output), or AssertionError at the deadline."""
        try:
            line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"{what}: timed out; output so far:\n{self.output}") from None
        if line is not None:
            self.lines.append(line)
        return line

    def wait_for(self, text: str, timeout_s: float) -> str:
        """The first line (from now on) containing ``text``."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = self._next(deadline, f"waiting for {text!r}")
            if line is None:
                raise AssertionError(f"demo ended before {text!r}:\n{self.output}")
            if text in line:
                return line

    def finish(self, timeout_s: float) -> int:
        """Read to the end; the exit status."""
        deadline = time.monotonic() + timeout_s
        while self._next(deadline, "waiting for the demo to end") is not None:
            pass
        return self.proc.wait(5.0)

    @property
    def took_s(self) -> float:
        return time.monotonic() - self.started

    def workdir(self) -> str:
        found = re.search(r"(/\S*fabric-demo-\w+)", self.output)
        assert found, self.output
        return found.group(1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def demo_runs() -> Iterator[list[DemoRun]]:
    runs: list[DemoRun] = []
    try:
        yield runs
    finally:
        for run in runs:
            run.close()
            if run.lines:  # kill what a broken demo left behind (there should be nothing)
                for pid in _demo_processes(run.workdir()):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _assert_nothing_left(run: DemoRun) -> None:
    workdir = run.workdir()
    deadline = time.monotonic() + 5.0
    while _demo_processes(workdir) and time.monotonic() < deadline:
        time.sleep(0.1)  # engines exit once their agent has
    assert _demo_processes(workdir) == [], "agents or engines outlived the demo"
    assert not Path(workdir).exists(), "the temporary FABRIC_HOME is removed"


def _sessions(output: str) -> dict[str, str]:
    """Short session id -> node name, from the demo's first lines."""
    return {sid: name for name, sid in re.findall(r"^  (node\d+)  session (\w{8})", output, re.M)}


skip_without_proc = pytest.mark.skipif(
    not Path("/proc").is_dir(), reason="needs /proc to look for leftovers"
)


@skip_without_proc
def test_demo_runs_to_completion_and_leaves_no_process_behind(
    demo_runs: list[DemoRun],
) -> None:
    run = DemoRun("--nodes", "3")
    demo_runs.append(run)
    code = run.finish(90.0)
    output = run.output
    assert code == 0, output
    assert run.took_s < 60, output
    assert "Traceback" not in output
    assert "every agent sees all 3 entries, all alive" in output
    # The registry as `fabric nodes` shows it: simulated engines on mixed GPUs, two models.
    assert re.search(r"serving +alive +http://127.0.0.1:\d+ +2xH100 +llama-3-8b", output)
    assert re.search(r"serving +alive +http://127.0.0.1:\d+ +1xA100-80G +llama-3-8b", output)
    assert re.search(r"serving +alive +http://127.0.0.1:\d+ +1xL40S +qwen2.5-7b", output)

    # Real requests through every agent, each answer naming the node (and GPU) that served it.
    step2 = output.split("\n2. ")[1].split("\n3. ")[0]
    served = re.findall(r"via (node\d) +(\S+) +-> served by (node\d) \(([^)]+)\)", step2)
    assert {via for via, _, _, _ in served} == {"node1", "node2", "node3"}, output
    gpu = {"node1": "H100", "node2": "A100-80G", "node3": "L40S"}
    model = {"node1": "llama-3-8b", "node2": "llama-3-8b", "node3": "qwen2.5-7b"}
    for _, asked, node, gpu_type in served:
        assert model[node] == asked and gpu[node] == gpu_type

    # The crash: the conversation's node is killed; its next turn is retried on the other
    # llama node; background requests through the survivors all get answers.
    step3 = output.split("\n3. ")[1].split("\n4. ")[0]
    victim = re.search(r"kill -9 (node\d) \(pid \d+\)", step3)
    assert victim, output
    victim_name = victim.group(1)
    other = "node2" if victim_name == "node1" else "node1"
    turns = re.findall(r"via node3 +llama-3-8b +-> served by (node\d)", step3)
    assert turns == [victim_name, other], output
    assert f"-> node3 tried {victim_name}, got no answer and retried on {other}" in step3
    assert f"{victim_name} is dead in every survivor's view" in step3
    during = re.search(r"requests during the crash: (\d+) sent, (\d+) answered, 0 failed", step3)
    assert during and int(during.group(1)) == int(during.group(2)) > 0, output
    assert f"answered by: {victim_name}" not in step3

    assert f"SIGTERM {other}" in output
    assert f"{other} is LEFT everywhere; it exited with status 0" in output
    assert "node3: exit 0" in output
    assert "Done in" in output
    _assert_nothing_left(run)


@skip_without_proc
def test_interrupted_demo_stops_every_agent(demo_runs: list[DemoRun]) -> None:
    run = DemoRun("--nodes", "3")
    demo_runs.append(run)
    run.wait_for("1. Registry converging", 60.0)
    run.proc.send_signal(signal.SIGINT)
    code = run.finish(30.0)
    assert code == 130, run.output
    assert "interrupted: stopping every agent" in run.output
    assert "Traceback" not in run.output
    _assert_nothing_left(run)


@skip_without_proc
def test_demo_serve_answers_on_the_printed_url_until_ctrl_c(demo_runs: list[DemoRun]) -> None:
    from openai import OpenAI

    run = DemoRun("--nodes", "3", "--serve")
    demo_runs.append(run)
    run.wait_for("Press Ctrl-C to stop", 60.0)
    output = run.output
    base = re.search(r"OpenAI base URL: (http://127\.0\.0\.1:\d+/v1)$", output, re.M)
    assert base, output
    others = re.search(r"other agents: +(.+)$", output, re.M)
    assert others, output
    assert f"curl -s {base.group(1)}/chat/completions" in output
    victim = re.search(r"kill -9 (node\d) \(pid \d+\)", output)
    assert victim, output
    sessions = _sessions(output)

    # The official client through the printed URL, and through every other agent.
    urls = [base.group(1)] + [f"{u.strip()}/v1" for u in others.group(1).split(",")]
    assert len(urls) == 2
    for url in urls:
        client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)
        assert sorted(m.id for m in client.models.list().data) == ["llama-3-8b", "qwen2.5-7b"]
        for model in ("llama-3-8b", "qwen2.5-7b"):
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert raw.parse().choices[0].message.content
            served = sessions[raw.headers["x-fabric-node"][:8]]
            assert served != victim.group(1)
    # The dashboard it prints is served there (the page and its files, from the package).
    agent_url = base.group(1).removesuffix("/v1")
    assert re.search(rf"dashboard: +{re.escape(agent_url)}/ui$", output, re.M), output
    page = httpx.get(f"{agent_url}/ui", timeout=5.0)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "content-security-policy" in page.headers
    # The admin command it suggests works against the same agent.
    listed = CliRunner().invoke(app, ["--agent", agent_url, "nodes", "--json"])
    assert listed.exit_code == 0, listed.output
    assert len(json.loads(listed.stdout)["nodes"]) == 3

    run.proc.send_signal(signal.SIGINT)
    code = run.finish(30.0)
    assert code == 0, run.output
    assert "Stopping the 2 agents (SIGTERM: each signs LEFT)" in run.output
    assert len(re.findall(r"node\d: exit 0", run.output)) == 2, run.output
    assert "Traceback" not in run.output
    _assert_nothing_left(run)
