"""``fabric demo``: a real mesh on this machine, shown step by step.

It runs N real ``fabric start`` processes (127.0.0.1, free ports, a fresh cluster key and
rendezvous file in a temporary ``FABRIC_HOME``), each with a simulated engine: two models on
mixed GPU types. Polling every agent's admin API, it:

1. shows the registry converge (what each agent sees of every entry) and the simulated engines
   turn SERVING, then the registry as ``fabric nodes`` would show it;
2. sends real chat requests (HTTP, OpenAI shape) through every agent, each of which is an
   ingress, and shows which node served each one;
3. starts a conversation (``X-Session-ID``) that sticks to one node, SIGKILLs that node, and
   sends the next turn through the same ingress: the ingress tries the dead node, gets no
   answer and retries on another one, so the client sees a normal answer. While the survivors'
   failure detectors declare the node suspect, then dead, background requests through every
   surviving agent keep being answered; their count and the ingresses' retries are printed;
4. SIGTERMs another node and shows its signed LEFT reach every other agent;
5. stops the rest gracefully (SIGTERM: each signs LEFT).

With ``serve=True`` step 4 and 5 are replaced by: keep the survivors up, print the OpenAI base
URL, an example ``curl`` and how to stop, and wait for Ctrl-C (SIGINT) or SIGTERM; then every
agent leaves gracefully and the status is 0.

Output goes to a ``Screen``: on a terminal, each waiting step is a live table (rich ``Live``) of
the registry as every watching agent sees it; otherwise (piped, CI, tests) plain lines, one
whenever what an agent sees changes. The step headings and summary lines are the same either way.

Every process is reaped on the way out, on success, error, Ctrl-C or SIGTERM (``LocalMesh``; an
interrupted demo first asks the agents to leave). The temporary directory is removed on success
and kept, with each agent's log, when something went wrong.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import httpx
from rich import box
from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cli.localmesh import AgentProcess, LocalMesh
from fabricnode.control.client import AdminClient
from fabricnode.control.views import Json
from fabricnode.errors import AgentApiError, FabricError

CONVERGE_TIMEOUT_S = 20.0
LEAVE_TIMEOUT_S = 10.0
DEAD_TIMEOUT_S = 20.0
POLL_INTERVAL_S = 0.2
REQUEST_TIMEOUT_S = 30.0
PLAIN_WIDTH = 120  # columns of the tables when the output is not a terminal
CONVERSATION = "demo-chat"

# (model, simulated GPU) per node, cycled: two models on mixed GPU types.
DEMO_FLEET = [
    ("llama-3-8b", "H100:2"),
    ("llama-3-8b", "A100-80G"),
    ("qwen2.5-7b", "L40S"),
    ("qwen2.5-7b", "RTX-3090:2"),
]
TOPICS = ("HPC", "GPUs", "Slurm", "gossip", "failover", "KV caches", "batching", "InfiniBand")

View = dict[str, Json] | None  # session id -> entry, as one agent sees it (None: no answer)


# -- output -------------------------------------------------------------------------------------


class Screen(Protocol):
    @property
    def matrix_columns(self) -> int:
        """How many agents' views fit side by side in a live table."""

    def say(self, text: str) -> None:
        """Lines of text, as they are (no markup)."""

    def show(self, renderable: RenderableType) -> None:
        """A table, printed once."""

    def watching(self) -> AbstractContextManager[Callable[[str, str, RenderableType], None]]:
        """A context giving ``update(stamp, line, table)``, called on every poll of a waiting
        step: ``line`` sums up what the watchers see, ``table`` shows it in full."""


class PlainScreen:
    """Plain lines: ``update`` prints its (stamped) line only when the line changed. For pipes,
    CI and tests."""

    matrix_columns = 8  # tables are not shown while watching; only their summary lines

    def __init__(self, write: Callable[[str], None] | None = None) -> None:
        self.write = write or _print_line

    def say(self, text: str) -> None:
        for line in text.split("\n"):
            self.write(line)

    def show(self, renderable: RenderableType) -> None:
        buffer = io.StringIO()
        console = Console(
            file=buffer, width=PLAIN_WIDTH, no_color=True, highlight=False, force_terminal=False
        )
        console.print(renderable)
        for line in buffer.getvalue().rstrip("\n").split("\n"):
            self.write(line.rstrip())

    @contextmanager
    def watching(self) -> Iterator[Callable[[str, str, RenderableType], None]]:
        last = ""

        def update(stamp: str, line: str, table: RenderableType) -> None:
            nonlocal last
            if line != last:
                self.write(f"  {stamp}  {line}")
                last = line

        yield update


class LiveScreen:
    """A terminal: waiting steps redraw a live table in place (the last one stays on screen)."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)

    @property
    def matrix_columns(self) -> int:
        # NODE, GPUS and MODEL take about 36 columns; an agent's column 10 (the last column,
        # which sums up the agents that do not fit, counts as two).
        return max(2, (self.console.width - 36) // 10)

    def say(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def show(self, renderable: RenderableType) -> None:
        self.console.print(renderable)

    @contextmanager
    def watching(self) -> Iterator[Callable[[str, str, RenderableType], None]]:
        with Live(console=self.console, refresh_per_second=10, transient=False) as live:
            yield lambda stamp, line, table: live.update(table, refresh=True)


def default_screen() -> Screen:
    return LiveScreen() if sys.stdout.isatty() else PlainScreen()


def _print_line(line: str) -> None:
    print(line, flush=True)


# -- background requests ------------------------------------------------------------------------


class Traffic:
    """Chat requests from background threads, round robin over (ingress, model), until stopped.

    Counts answers by serving node and failures by reason: what a client of the mesh would see.
    """

    def __init__(self, targets: list[tuple[AgentProcess, str]], workers: int = 2) -> None:
        self.targets = targets
        self.workers = workers
        self.answered: Counter[str] = Counter()  # serving session id -> answers
        self.failed: Counter[str] = Counter()  # reason -> count
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(k,), daemon=True, name=f"demo-traffic-{k}")
            for k in range(workers)
        ]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 1)

    @property
    def total(self) -> int:
        return sum(self.answered.values()) + sum(self.failed.values())

    def _run(self, k: int) -> None:
        i = k
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            while not self._stop.is_set():
                ingress, model = self.targets[i % len(self.targets)]
                i += self.workers
                try:
                    r = client.post(ingress.http_url + "/v1/chat/completions", json=_chat(model, i))
                except httpx.HTTPError as exc:
                    self._count(None, type(exc).__name__)
                else:
                    if r.status_code == 200:
                        self._count(r.headers.get("x-fabric-node", "?"), None)
                    else:
                        self._count(None, f"HTTP {r.status_code}")
                self._stop.wait(0.02)

    def _count(self, served: str | None, failure: str | None) -> None:
        with self._lock:
            if served is not None:
                self.answered[served] += 1
            if failure is not None:
                self.failed[failure] += 1


def _chat(model: str, i: int, **extra: Any) -> Json:
    topic = TOPICS[i % len(TOPICS)]
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Say something about {topic}."}],
        "max_tokens": 6,
        **extra,
    }


def ingress_retries(agent: AgentProcess) -> int:
    """The agent's ``fabric_ingress_retries_total`` (all reasons): attempts that failed over."""
    try:
        with AdminClient(agent.http_url, timeout_s=2.0) as client:
            text = client.metrics()
    except AgentApiError:
        return 0
    pattern = r"^fabric_ingress_retries_total(?:\{[^}]*\})? (\S+)$"
    return int(sum(float(v) for v in re.findall(pattern, text, re.MULTILINE)))


# -- the demo -----------------------------------------------------------------------------------


class Demo:
    def __init__(
        self,
        mesh: LocalMesh,
        nodes: int,
        screen: Screen,
        *,
        serve: bool = False,
        port: int | None = None,
    ) -> None:
        self.mesh = mesh
        self.nodes = nodes
        self.screen = screen
        self.serve = serve
        self.port = port
        self.t0 = time.monotonic()
        self.agents: list[AgentProcess] = []
        self.fleet: dict[str, tuple[str, str]] = {}  # agent name -> (model, GPU spec)
        self.requests_sent = 0

    def say(self, text: str) -> None:
        self.screen.say(text)

    def stamp(self) -> str:
        return f"{time.monotonic() - self.t0:5.1f}s"

    # -- looking -----------------------------------------------------------------------------

    def name_of(self, sid: str) -> str:
        for a in self.agents:
            if a.session_id == sid:
                return a.name
        return sid[:8] or "?"

    def label_of(self, sid: str) -> str:
        """``node2 (A100-80G)``: the node and its GPU type."""
        name = self.name_of(sid)
        gpu = self.fleet.get(name, ("", "?"))[1].split(":")[0]
        return f"{name} ({gpu})"

    def view(self, agent: AgentProcess) -> View:
        try:
            with AdminClient(agent.http_url, timeout_s=1.0) as client:
                return {n["session_id"]: n for n in client.nodes()}
        except AgentApiError:
            return None

    def watch(
        self,
        title: str,
        watchers: list[AgentProcess],
        describe: Callable[[View], str],
        done: Callable[[View], bool],
        timeout_s: float,
        what: str,
    ) -> None:
        """Poll every watcher until all are ``done``: a line when ``describe`` changes (plain),
        or the live registry table (terminal)."""
        deadline = time.monotonic() + timeout_s
        with self.screen.watching() as update:
            while True:
                views = [self.view(a) for a in watchers]
                pairs = zip(watchers, views, strict=True)
                line = "  ".join(f"{a.name}: {describe(v)}" for a, v in pairs)
                update(self.stamp(), line, self.registry_matrix(title, watchers, views))
                if all(done(v) for v in views):
                    return
                if time.monotonic() > deadline:
                    raise FabricError(f"{what} did not happen within {timeout_s:g} s")
                time.sleep(POLL_INTERVAL_S)

    def registry_matrix(
        self, title: str, watchers: list[AgentProcess], views: list[View]
    ) -> RenderableType:
        """Every node (rows) as each watcher sees it (columns): its state while alive, else
        ``suspect``, ``DEAD`` or ``left``. Watchers past what fits are summed up in one column."""
        table = Table(
            title=f"{title}  ({self.stamp().strip()})",
            title_justify="left",
            caption="columns: each agent's view (-: not yet, ?: no answer)",
            caption_justify="left",
            box=box.SIMPLE_HEAD,
            header_style="bold",
        )
        for column in ("NODE", "GPUS", "MODEL"):
            table.add_column(column, no_wrap=True)
        fit = max(2, self.screen.matrix_columns)
        shown = watchers if len(watchers) <= fit else watchers[: fit - 2]
        for a in shown:
            table.add_column(a.name, no_wrap=True)
        rest = views[len(shown) :]
        if rest:
            table.add_column(f"other {len(rest)}", no_wrap=True)
        for agent in self.agents:
            model, gpu = self.fleet[agent.name]
            cells = [_seen_cell(v, agent.session_id) for v in views]
            row = cells[: len(shown)]
            if rest:
                counts = Counter(c.plain for c in cells[len(shown) :])
                top, n = counts.most_common(1)[0]
                style = next(c.style for c in cells[len(shown) :] if c.plain == top)
                text = f"all {top}" if n == len(rest) else f"{n} {top}, {len(rest) - n} other"
                row.append(Text(text, style))
            table.add_row(agent.name, _gpu_label(gpu), model, *row)
        return table

    def registry_table(self, agent: AgentProcess) -> RenderableType:
        """The registry as ``agent`` sees it, in the columns of ``fabric nodes``."""
        table = Table(box=box.SIMPLE_HEAD, header_style="bold", show_edge=False)
        for column in ("SESSION", "PROVIDER", "STATE", "LIVENESS", "HTTP", "GPUS", "MODELS"):
            table.add_column(column, no_wrap=True)
        order = {a.session_id: i for i, a in enumerate(self.agents)}
        entries = (self.view(agent) or {}).values()
        for e in sorted(entries, key=lambda e: order.get(e["session_id"], len(order))):
            hw = e["hardware"]
            table.add_row(
                e["session_id"][:12],
                e["provider"],
                e["state"],
                e["liveness"],
                e["addresses"]["http"],
                f"{hw['gpu_count']}x{hw['gpu_type']}",
                ", ".join(m["id"] for m in e["models"]) or "-",
            )
        return table

    # -- acting ------------------------------------------------------------------------------

    def request(self, ingress: AgentProcess, model: str, *, session: str | None = None) -> str:
        """One chat request through ``ingress``; prints who served it. Returns that session id."""
        self.requests_sent += 1
        headers = {"x-session-id": session} if session else {}
        t0 = time.monotonic()
        try:
            r = httpx.post(
                ingress.http_url + "/v1/chat/completions",
                json=_chat(model, self.requests_sent),
                headers=headers,
                timeout=REQUEST_TIMEOUT_S,
            )
        except httpx.HTTPError as exc:
            raise FabricError(f"request through {ingress.name} failed: {exc}") from None
        ms = (time.monotonic() - t0) * 1000
        if r.status_code != 200:
            raise FabricError(f"request through {ingress.name} answered {r.status_code}: {r.text}")
        sid = str(r.headers.get("x-fabric-node", ""))
        text = r.json()["choices"][0]["message"]["content"].strip()
        self.say(
            f"  via {ingress.name:6} {model:11} -> served by {self.label_of(sid):18} "
            f"{ms:5.0f} ms  {text!r}"
        )
        return sid

    def start_agents(self) -> None:
        n = self.nodes
        self.say(
            f"Starting {n} agents on 127.0.0.1, simulated engines, no GPU needed "
            f"(key and rendezvous in {self.mesh.workdir})"
        )
        fleet = [DEMO_FLEET[i % len(DEMO_FLEET)] for i in range(n)]
        for i, (model, gpu) in enumerate(fleet):
            args = ["--sim", model, "--sim-gpu", gpu]
            if i == _ingress_index(fleet) and self.port is not None:
                args += ["--http", f"127.0.0.1:{self.port}"]  # the last --http wins
            agent = self.mesh.start(wait=False, args=args)
            self.agents.append(agent)
            self.fleet[agent.name] = (model, gpu)
        for a in self.agents:
            a.wait_ready(30.0)
        for a in self.agents:
            model, gpu = self.fleet[a.name]
            self.say(
                f"  {a.name}  session {a.session_id[:8]}  {_gpu_label(gpu):11} {model:11} "
                f"http {a.http_url}  gossip {a.gossip_addr}"
            )
        self.say(f"  dashboard: {self.agents[0].http_url}/ui  (every agent serves it)")

    def converge(self) -> None:
        agents, n = self.agents, self.nodes
        self.say(f"\n1. Registry converging: entries each agent sees (of {n})")
        self.watch(
            "Registry converging",
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
            "Engines loading",
            agents,
            lambda v: "?" if v is None else _count_states(v),
            lambda v: (
                v is not None and len(v) == n and all(e["state"] == "serving" for e in v.values())
            ),
            CONVERGE_TIMEOUT_S,
            "engines serving",
        )
        first = agents[0].name
        self.say(f"  every node is SERVING; the registry as {first} sees it (`fabric nodes`):")
        self.screen.show(self.registry_table(agents[0]))

    def send_requests(self) -> None:
        self.say("\n2. Requests through every agent (each one is an OpenAI endpoint)")
        for ingress in self.agents:
            for model in self.models():
                self.request(ingress, model)

    def crash(self) -> tuple[list[AgentProcess], AgentProcess]:
        """Step 3; returns the survivors and the ingress the conversation went through."""
        fleet = [self.fleet[a.name] for a in self.agents]
        model = _crash_model(fleet)
        via = self.agents[_ingress_index(fleet)]
        self.say(
            f"\n3. A crash: kill -9 the node holding a conversation; its requests fail over\n"
            f"  a conversation (X-Session-ID: {CONVERSATION}) through {via.name} sticks to one "
            f"node serving {model}:"
        )
        victim_sid = self.request(via, model, session=CONVERSATION)
        victim = next(a for a in self.agents if a.session_id == victim_sid)
        before = ingress_retries(via)
        victim.kill()
        _wait_quietly(victim, 5.0)
        self.say(f"  kill -9 {victim.name} (pid {victim.pid}); the next turn, at once:")
        served = self.request(via, model, session=CONVERSATION)
        retried = ingress_retries(via) - before
        if retried:
            self.say(
                f"  -> {via.name} tried {victim.name}, got no answer and retried on "
                f"{self.name_of(served)} ({retried} retr{'y' if retried == 1 else 'ies'}): "
                "the client saw a normal answer"
            )
        else:
            self.say(f"  -> {via.name} routed the turn to {self.name_of(served)} directly")

        survivors = [a for a in self.agents if a is not victim]
        sid = victim.session_id
        targets = [(a, m) for a in survivors for m in self.models()]
        self.say(
            f"  meanwhile requests keep flowing through {len(survivors)} agents while the "
            f"survivors' failure detectors decide {victim.name} is dead (suspect, then dead):"
        )
        retries_before = sum(ingress_retries(a) for a in survivors)
        with Traffic(targets) as traffic:
            self.watch(
                f"{victim.name} killed",
                survivors,
                lambda v: _liveness_of(v, sid),
                lambda v: v is not None and sid in v and v[sid]["liveness"] == "dead",
                DEAD_TIMEOUT_S,
                f"{victim.name}'s death being detected",
            )
        retries = sum(ingress_retries(a) for a in survivors) - retries_before
        self.say(f"  {victim.name} is dead in every survivor's view")
        answered = sum(traffic.answered.values())
        failed = sum(traffic.failed.values())
        by_node = ", ".join(
            f"{self.name_of(s)} {c}" for s, c in sorted(traffic.answered.items(), key=_by_count)
        )
        reasons = ", ".join(f"{r} {c}" for r, c in traffic.failed.most_common())
        self.say(
            f"  requests during the crash: {traffic.total} sent, {answered} answered, "
            f"{failed} failed{f' ({reasons})' if reasons else ''}; "
            f"{retries} attempt{'s' if retries != 1 else ''} retried on another node"
        )
        if by_node:
            self.say(f"  answered by: {by_node}")
        return survivors, via

    def leave(self, survivors: list[AgentProcess], via: AgentProcess) -> list[AgentProcess]:
        """Step 4; returns the agents still running."""
        leaver = next((a for a in survivors if a is not via), survivors[0])
        rest = [a for a in survivors if a is not leaver]
        sid = leaver.session_id
        self.say(f"\n4. SIGTERM {leaver.name} ({sid[:8]}): it signs LEFT, gossips it, exits")
        leaver.terminate()
        self.watch(
            f"{leaver.name} leaving",
            rest,
            lambda v: _state_of(v, sid),
            lambda v: v is not None and sid in v and v[sid]["state"] == "left",
            LEAVE_TIMEOUT_S,
            f"{leaver.name}'s LEFT spreading",
        )
        code = _exit_code(leaver)
        self.say(f"  {leaver.name} is LEFT everywhere; it exited with status {code}")
        return rest

    def stop(self, rest: list[AgentProcess], heading: str) -> None:
        self.say(f"\n{heading}")
        codes = self.mesh.stop_all()
        self.say("  " + "  ".join(f"{a.name}: exit {codes[a.name]}" for a in rest))

    def serve_until_stopped(self, survivors: list[AgentProcess]) -> None:
        first = survivors[0]
        base = f"{first.http_url}/v1"
        body = {
            "model": self.models()[0],
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 16,
        }
        curl = (
            f"curl -s {base}/chat/completions -H 'content-type: application/json' \\\n"
            f"       -d {shlex.quote(json.dumps(body))}"
        )
        others = ", ".join(a.http_url for a in survivors[1:])
        # A node to crash by hand whose model another survivor also serves.
        spare = [
            a
            for a in survivors[1:]
            if sum(self.fleet[b.name][0] == self.fleet[a.name][0] for b in survivors) >= 2
        ]
        crash = (
            f"        kill -9 {spare[-1].pid}     # crash {spare[-1].name}: requests fail over\n"
            if spare
            else ""
        )
        self.say(
            f"\nServing {len(survivors)} agents with models {', '.join(self.models())}; "
            "any agent is an OpenAI endpoint.\n"
            f"  OpenAI base URL: {base}\n"
            f"  dashboard:       {first.http_url}/ui\n"
            f"  other agents:    {others or '-'}\n"
            f"  try:  {curl}\n"
            f"        fabric --agent {first.http_url} nodes\n"
            f"{crash}"
            "Press Ctrl-C to stop (or send SIGTERM to this process, pid "
            f"{os.getpid()}): every agent leaves the mesh and exits."
        )
        reported: set[str] = set()
        try:
            while True:
                time.sleep(0.5)
                for a in survivors:
                    if not a.running and a.name not in reported:
                        reported.add(a.name)
                        self.say(f"  {a.name} exited (status {a.proc.returncode})")
                if len(reported) == len(survivors):
                    raise FabricError("every agent has exited")
        except KeyboardInterrupt:
            pass
        running = [a for a in survivors if a.running]
        self.stop(running, f"Stopping the {_agents(len(running))} (SIGTERM: each signs LEFT)")

    def models(self) -> list[str]:
        return sorted({m for m, _ in self.fleet.values()})

    def run(self) -> int:
        self.start_agents()
        self.converge()
        self.send_requests()
        survivors, via = self.crash()
        if self.serve:
            self.serve_until_stopped([via, *(a for a in survivors if a is not via)])
        else:
            rest = self.leave(survivors, via)
            self.stop(rest, f"5. Stopping the remaining {_agents(len(rest))} (SIGTERM)")
        self.say(f"\nDone in {time.monotonic() - self.t0:.1f} s.")
        return 0


def _crash_model(fleet: list[tuple[str, str]]) -> str:
    """The first model that more than one node serves: its requests can fail over."""
    models = [m for m, _ in fleet]
    return next(m for m in sorted(set(models)) if models.count(m) >= 2)


def _ingress_index(fleet: list[tuple[str, str]]) -> int:
    """The agent the crash step's conversation goes through: the last one not serving the
    crash model, so it is never the node killed nor (step 4) the one that leaves. With
    ``--port`` it is the one on that port."""
    model = _crash_model(fleet)
    return max(i for i, (m, _) in enumerate(fleet) if m != model)


def _agents(n: int) -> str:
    return f"{n} agent{'s' if n != 1 else ''}"


def _by_count(item: tuple[str, int]) -> tuple[int, str]:
    return (-item[1], item[0])


def _gpu_label(spec: str) -> str:
    """``H100:2`` -> ``2xH100``."""
    parts = spec.split(":")
    count = parts[1] if len(parts) > 1 and parts[1] else "1"
    return f"{count}x{parts[0]}"


def _seen_cell(view: View, sid: str) -> Text:
    if view is None:
        return Text("?", style="dim")
    entry = view.get(sid)
    if entry is None:
        return Text("-", style="dim")
    return _state_cell(entry["state"], entry["liveness"])


def _state_cell(state: str, liveness: str) -> Text:
    """``serving`` (green) / ``join`` (cyan) while alive, else ``suspect``, ``DEAD``, ``left``."""
    if liveness == "alive":
        return Text(state, style="green" if state == "serving" else "cyan")
    if liveness == "dead":
        return Text("DEAD", style="bold red")
    return Text(liveness, style="yellow" if liveness == "suspect" else "dim")


def _count_states(view: dict[str, Json]) -> str:
    """``2 serving 2 join``."""
    counts = Counter(e["state"] for e in view.values())
    return " ".join(f"{counts[s]} {s}" for s in ("serving", "join", "down", "left") if counts[s])


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


def _wait_quietly(agent: AgentProcess, timeout_s: float) -> None:
    try:
        agent.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_demo(
    nodes: int = 4,
    *,
    serve: bool = False,
    port: int | None = None,
    screen: Screen | None = None,
) -> int:
    """Run the demo; returns the exit status: 0, or 130 when interrupted before its end
    (with ``serve``, Ctrl-C is the normal end: 0). FabricError (logs kept) if a step fails."""
    if nodes < 3:
        raise FabricError("the demo needs at least 3 nodes (one crashes, one leaves)")
    out = screen or default_screen()
    workdir = Path(tempfile.mkdtemp(prefix="fabric-demo-"))
    # SIGTERM stops the demo as Ctrl-C does (the agents leave) rather than orphaning them; and
    # Ctrl-C works even when started where SIGINT is ignored (a shell script's `&`).
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _interrupt)
    ok = False
    try:
        with LocalMesh(workdir, provider="demo") as mesh:
            try:
                code = Demo(mesh, nodes, out, serve=serve, port=port).run()
            except KeyboardInterrupt:
                out.say("\ninterrupted: stopping every agent")
                try:
                    mesh.stop_all(timeout_s=5.0)
                except KeyboardInterrupt:
                    pass  # a second Ctrl-C: leaving the `with` kills the rest
                code = 130
        ok = True
        return code
    except FabricError as exc:
        raise FabricError(f"demo failed: {exc} (agent logs kept in {workdir})") from exc
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
