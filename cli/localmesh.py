"""Real agents as local subprocesses: what ``fabric demo`` and the integration tests run.

``LocalMesh`` owns a work directory (cluster keyring, rendezvous file, one stdout and one stderr
file per agent) and every ``fabric start`` process it spawns, on 127.0.0.1 with port 0 for HTTP
and gossip. Leaving its ``with`` block kills whatever is still running, whatever went wrong, so
no agent outlives a demo or a test. On Linux each agent also gets ``PR_SET_PDEATHSIG``: if the
parent is killed outright, the kernel kills the agents too.

An agent's stdout goes to a file rather than a pipe (nothing can block on a full pipe);
``AgentProcess.wait_ready`` polls it for the ready lines documented in ``fabricnode.agent``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fabricnode.agent import AgentAddresses, parse_ready_lines
from fabricnode.errors import FabricError
from fabricnode.mesh.keyring import Keyring, new_cluster_key
from fabricnode.mesh.schema import NAME_LABEL

# Environment variables that would make a spawned agent (or a client command run with
# ``LocalMesh.env()``) depend on the caller's set-up: the FABRIC_* variables that
# ``fabricnode.config.load_config`` and the CLI's ``--agent`` read. ``env()`` drops them all and
# sets FABRIC_HOME to the work directory, so keyring, rendezvous file and logs default to it.
ISOLATED_ENV = (
    "FABRIC_JOIN",
    "FABRIC_CLUSTER_KEY",
    "FABRIC_AGENT",
    "FABRIC_HOME",
    "FABRIC_RENDEZVOUS",
    "FABRIC_LOG_DIR",
    "FABRIC_JOB_LOG_DIR",
    "FABRIC_LEAVE_BEFORE_END",
    "FABRIC_SITE",
)


def agent_command(*args: str) -> list[str]:
    """``fabric start ARGS`` run with this interpreter (no need for the script on PATH)."""
    return [sys.executable, "-m", "cli.main", "start", *args]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform == "linux":
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


@dataclass
class AgentProcess:
    name: str
    proc: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path
    addrs: AgentAddresses | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def http_url(self) -> str:
        return self._ready().http_url

    @property
    def gossip_addr(self) -> str:
        return self._ready().gossip_addr

    @property
    def session_id(self) -> str:
        return self._ready().session_id

    def _ready(self) -> AgentAddresses:
        if self.addrs is None:
            raise FabricError(f"agent {self.name} has not printed its addresses yet")
        return self.addrs

    def wait_ready(self, timeout_s: float = 30.0) -> AgentAddresses:
        """Wait for the ready lines; FabricError (with its last log line) if it exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                text = self.stdout_path.read_text(errors="replace")
            except OSError:
                text = ""
            addrs = parse_ready_lines(text)
            if addrs is not None:
                self.addrs = addrs
                return addrs
            code = self.proc.poll()
            if code is not None:
                raise FabricError(
                    f"agent {self.name} exited with status {code} before it was ready: "
                    f"{self.stderr_tail(1) or '(no output)'}"
                )
            if time.monotonic() > deadline:
                raise FabricError(f"agent {self.name} not ready after {timeout_s:g} s")
            time.sleep(0.05)

    def signal(self, signum: int) -> None:
        if self.running:
            try:
                self.proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM: the agent leaves gracefully (signs LEFT) and exits 0."""
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: a crash, as far as the mesh can tell."""
        self.signal(signal.SIGKILL)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def stderr_tail(self, lines: int = 20) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


@dataclass
class LocalMesh:
    """Agents sharing one cluster keyring and one rendezvous file under ``workdir``."""

    workdir: Path
    log_level: str = "info"
    provider: str = "local"
    # Run the agents from another checkout's sources (``python -m cli.main`` in that folder):
    # bench/routing.py --source compares an earlier commit against this one in one run.
    source: Path | None = None
    agents: list[AgentProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.key_path = self.workdir / "cluster.key"
        self.rendezvous_path = self.workdir / "rendezvous"
        if not self.key_path.exists():
            Keyring.with_key(new_cluster_key()).save(self.key_path)

    def __enter__(self) -> LocalMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ISOLATED_ENV}
        env["FABRIC_HOME"] = str(self.workdir)
        env.update(extra or {})
        return env

    def start(
        self,
        name: str | None = None,
        *,
        cluster_key: Path | None = None,
        args: Sequence[str] = (),
        wait: bool = True,
        timeout_s: float = 30.0,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
    ) -> AgentProcess:
        """Spawn one agent (and by default wait until it prints its addresses); ``env`` adds
        to the mesh's environment. ``host``: the address its HTTP and gossip ports bind (port
        0: any free one); ``prefix``: a command the agent's runs under (``ip netns exec NS``
        for a node of the emulated sites: it execs the agent, whose pid it keeps)."""
        name = name or f"node{len(self.agents) + 1}"
        stdout_path = self.workdir / f"{name}.out"
        stderr_path = self.workdir / f"{name}.log"
        command = agent_command(
            "--http",
            f"{host}:0",
            "--gossip",
            f"{host}:0",
            "--rendezvous",
            str(self.rendezvous_path),
            "--cluster-key",
            str(cluster_key or self.key_path),
            "--provider",
            self.provider,
            "--label",
            f"{NAME_LABEL}={name}",
            "--log-level",
            self.log_level,
            *args,
        )
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            proc = subprocess.Popen(
                [*prefix, *command],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=self.env(env),
                cwd=self.source,
                start_new_session=True,  # a terminal's Ctrl-C goes to us; we stop the agents
                preexec_fn=_die_with_parent,
            )
        agent = AgentProcess(name, proc, stdout_path, stderr_path)
        self.agents.append(agent)
        if wait:
            agent.wait_ready(timeout_s)
        return agent

    def start_many(self, count: int, *, timeout_s: float = 30.0) -> list[AgentProcess]:
        """Spawn ``count`` agents at once, then wait for all of them."""
        started = [self.start(wait=False) for _ in range(count)]
        for agent in started:
            agent.wait_ready(timeout_s)
        return started

    def running(self) -> list[AgentProcess]:
        return [a for a in self.agents if a.running]

    def stop_all(self, timeout_s: float = 10.0) -> dict[str, int]:
        """SIGTERM every running agent, wait, SIGKILL laggards; returns exit status by name."""
        for agent in self.running():
            agent.terminate()
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int] = {}
        for agent in self.agents:
            try:
                codes[agent.name] = agent.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                agent.kill()
                codes[agent.name] = agent.wait(5.0)
        return codes

    def close(self) -> None:
        """Kill (SIGKILL) whatever still runs and reap every process; never raises."""
        for agent in self.agents:
            if agent.running:
                agent.kill()
        for agent in self.agents:
            try:
                agent.wait(10.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL did not work
                pass


def wait_until(predicate: Callable[[], bool], timeout_s: float, *, interval_s: float = 0.2) -> bool:
    """Poll ``predicate`` until true or ``timeout_s``; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
