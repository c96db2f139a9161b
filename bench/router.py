"""Router overhead, side by side in one run: added latency and CPU of a router in front of the
same fake backend, for fabric's ingress and for the routers it is measured against.

Targets (all in front of ONE fake backend process: ``bench/fake_backend.py``, or with
``--backend aiohttp`` ``bench/aiohttp_backend.py``, the notes' setup):

  direct        the client talks to the backend itself: the baseline every "added" is against
  vllm-router   the Rust router from PyPI (policy round_robin), in its own venv (bench/_venvs.py)
  litellm       ``litellm[proxy]`` from PyPI, the backend as an ``openai/`` model, no telemetry,
                no database, no UI
  trio-floor    ``bench/trio_floor.py``: the least a trio + httptools relay does per request (one
                upstream connection per client connection, bytes passed on whole; no routing,
                filters, timeouts, metrics or accounting; the data plane's reactor): what the
                design's event loop, reactor and parser cost on their own, the floor under the
                fabric targets
  fabric-1hop   one ``fabric start`` agent supervising the backend as its engine child; the
                client talks to that agent's ``/v1`` (ingress = serving node)
  fabric-2hop   a second agent without an engine in the same mesh is the ingress:
                client → ingress agent → serving agent → backend
  fabric-sites  across two sites (docs/federation.md): the serving agent's mesh is site
                ``default`` with a gateway, a second mesh is site ``A`` with a gateway, and the
                client talks to A's gateway: client → gateway A → (TLS, the federation link) →
                gateway of default → serving agent → backend. Its +mean less fabric-2hop's is
                what one gateway hop adds (loopback: no RTT)

When a fabric target is asked for, the backend IS the serving agent's engine child, and every
other target uses that same process; otherwise the bench starts the backend itself.

Method (results in docs/benchmarks.md): closed-loop clients on keep-alive connections
(bench/_loadgen.py, a process of its own: asyncio protocols + httptools, cheap next to any
router), 2000-byte prompts, cells = concurrency x modes, ``--seconds`` per cell after a
short warm-up, ``--rounds`` rounds. Modes (``--modes``, default ``json,sse``: the chat cells, whose
requests and answers are the same bytes as before the other modes existed):

  json           POST /v1/chat/completions, one JSON answer with usage
  sse            the same streamed: 16 content chunks, a usage chunk and [DONE]
  audio          POST /v1/audio/transcriptions, multipart/form-data: a WAV file of
                 ``--audio-bytes`` (64 KiB; stdlib ``wave``, made once) and then the ``model``
                 field, after the file (a router must read past the file to route); the backend
                 answers ``{"text": ...}`` as vLLM does
  responses-sse  POST /v1/responses with ``stream: true`` and the prompt as ``input``; the
                 backend streams the Responses events: created, in_progress, output_item.added,
                 content_part.added, 16 output_text.delta (as many text chunks as sse),
                 output_text.done, content_part.done, output_item.done, completed with usage

Before a target is measured in a mode other than the chat ones, one request of that mode goes
through it; if it fails (a 404 of a router without that path, an error), the target's cells of
that mode are not measured and the report says "unsupported" with the answer it got.

Within a round every cell runs every target back to back (the order rotates each round), so
host noise hits all targets alike. Reported per target and cell
(computed in bench/_router_report.py):

  mean / p50 / p99   latency of whole requests (last byte), pooled over rounds, ms
  +mean              target mean minus direct mean in the same round and cell; median of rounds
  x vllm             +mean divided by vllm-router's +mean in the same cell
  CPU/req            utime+stime of the router's processes (/proc/PID/stat) over the recorded
                     window / requests completed in it, ms. fabric: the agent process(es) only
                     (both agents for 2hop), never the engine; litellm: all its processes
  req/s              completed requests per second (median of rounds); at c=32 the throughput
  TTFT               time to the first body bytes of a stream, mean, ms
  +us/chunk          (+mean of the sse cell - +mean of the json cell at the same concurrency)
                     / 18 SSE events (16 content chunks, the usage chunk, [DONE]): the latency
                     relaying a stream adds per chunk beyond one JSON response (median of
                     rounds; at c=32 it also carries the queueing of a saturated router); for
                     responses-sse the same against the chat json cell / 24 events (so it also
                     carries what the Responses request costs beyond a chat one)
  CPU us/chunk       the same difference for router CPU per request: CPU per relayed chunk
  err                failed requests (non-200, broken stream, connection errors) in the windows

The 2 cores are shared by load generator, router(s) and backend, as in the notes' setup. A noisy
host moves absolute numbers (not rankings), so the header shows steal time over the run and the
share of CPU that other processes took during the recorded windows (the fabric agents of other
targets idle in the background; anything else running on the machine shows here).

    python bench/router.py                                   # all targets, 5 rounds x 2 s cells
    python bench/router.py --targets direct,vllm-router,litellm --rounds 5 --json out.json
    python bench/router.py --quick --targets direct,fabric-1hop   # smoke run, a few seconds
    python bench/router.py --modes json,sse,audio,responses-sse --targets direct,fabric-1hop

Every process it starts is in a process group of its own with a parent-death signal and is
killed (the group) on exit, Ctrl-C or failure. Work files (configs, logs) live in a temporary
directory, kept with ``--keep-workdir``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python bench/router.py` from anywhere finds fabricnode
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import _venvs  # noqa: E402
from _loadgen import API_AUDIO, API_CHAT, API_RESPONSES, done_marker, request_body  # noqa: E402
from _procs import argv_of, cpu_steal, descendants, free_port, rss_mb  # noqa: E402
from _router_report import (  # noqa: E402
    MODES,
    Cell,
    bystanders_pct,
    finite,
    fmt,
    mean,
    median,
    others_pct,
    render,
    summarize,
)

from fabricnode import native  # noqa: E402

MODEL = "bench-model"
CHAT_PATH = "/v1/chat/completions"
# mode -> (path, load generator api); json and sse are the chat cells
MODE_REQUESTS = {
    "json": (CHAT_PATH, API_CHAT),
    "sse": (CHAT_PATH, API_CHAT),
    "audio": ("/v1/audio/transcriptions", API_AUDIO),
    "responses-sse": ("/v1/responses", API_RESPONSES),
}
ALL_TARGETS = (
    "direct",
    "vllm-router",
    "litellm",
    "trio-floor",
    "fabric-1hop",
    "fabric-2hop",
    "fabric-sites",
)
FABRIC_TARGETS = ("fabric-1hop", "fabric-2hop", "fabric-sites")


class Unavailable(Exception):
    """A target cannot be measured; the message is the one-line reason shown in the report."""


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# -- processes ----------------------------------------------------------------------------------


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform == "linux":
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PDEATHSIG
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Processes:
    """Every process group this bench started; ``close`` kills them all (TERM, then KILL)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.extra_groups: list[int] = []  # groups started by our children (fabric's engine)
        self.cleanups: list[Callable[[], None]] = []

    def spawn(
        self, name: str, argv: list[str], *, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        out = open(self.workdir / f"{name}.out", "wb")  # noqa: SIM115 - closed right below
        err = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            out.close()
            err.close()
        self.procs.append(proc)
        return proc

    def log_tail(self, name: str, lines: int = 3) -> str:
        try:
            text = (self.workdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def close(self) -> None:
        for cleanup in reversed(self.cleanups):
            try:
                cleanup()
            except Exception as exc:  # keep cleaning up whatever else there is
                log(f"cleanup: {exc}")
        groups = [p.pid for p in self.procs if p.poll() is None] + self.extra_groups
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pgid in groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, sig)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                time.sleep(0.05)
            if sig == signal.SIGTERM:
                groups = [p.pid for p in self.procs if p.poll() is None] + [
                    g for g in self.extra_groups if _alive(g)
                ]
                if not groups:
                    break
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)


# -- HTTP probes (control path only; the load goes through bench/_loadgen.py) ----------------


def http_request(
    port: int, method: str, path: str, body: bytes | None = None, timeout_s: float = 5.0
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def wait_until(check: Callable[[], str | None], timeout_s: float, what: str) -> None:
    """Poll ``check`` (None = done, else why not yet) until done; Unavailable on timeout."""
    deadline = time.monotonic() + timeout_s
    why = "no answer"
    while True:
        try:
            result = check()
        except (OSError, http.client.HTTPException) as exc:
            result = f"{type(exc).__name__}: {exc}"
        if result is None:
            return
        why = result
        if time.monotonic() > deadline:
            raise Unavailable(f"{what} not ready after {timeout_s:g} s ({why})")
        time.sleep(0.2)


def probe_completions(port: int, path: str = CHAT_PATH) -> dict[str, str]:
    """One JSON and one streamed chat completion through a target; Unavailable if either fails."""
    info: dict[str, str] = {}
    for stream in (False, True):
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "probe"}],
                "max_tokens": 16,
                "stream": stream,
            }
        ).encode()
        status, headers, data = http_request(port, "POST", path, body, timeout_s=30.0)
        kind = "stream" if stream else "json"
        if status != 200:
            raise Unavailable(f"probe {kind} request: HTTP {status} {data[:160]!r}")
        if stream and b"[DONE]" not in data:
            raise Unavailable(f"probe stream without [DONE]: {data[-160:]!r}")
        if not stream and b'"usage"' not in data:
            raise Unavailable(f"probe response without usage: {data[:160]!r}")
        if "x-fabric-node" in headers:
            info["x-fabric-node"] = headers["x-fabric-node"]
    return info


def mode_spec(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """The load generator's request keys for a mode (bench/_loadgen.py)."""
    path, api = MODE_REQUESTS[mode]
    return {
        "path": path,
        "api": api,
        "model": MODEL,
        "stream": mode in ("sse", "responses-sse"),
        "prompt_bytes": args.prompt_bytes,
        "audio_bytes": args.audio_bytes,
    }


def probe_mode(port: int, mode: str, args: argparse.Namespace) -> str | None:
    """One request of ``mode`` through a target, as the load sends it: None if it is served,
    else the answer (the reason the target is reported unsupported for the mode)."""
    spec = mode_spec(mode, args)
    content_type, body = request_body(spec)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30.0)
    try:
        conn.request("POST", spec["path"], body=body, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        status, data = resp.status, resp.read()
    except (OSError, http.client.HTTPException) as exc:
        return f"POST {spec['path']}: {type(exc).__name__}: {exc}"
    finally:
        conn.close()
    if status != 200:
        return f"POST {spec['path']}: HTTP {status} {data[:200]!r}"
    marker = done_marker(spec)
    if marker is not None and marker not in data:
        return f"POST {spec['path']}: stream without {marker.decode()}: {data[-200:]!r}"
    if mode == "audio" and b'"text"' not in data:
        return f"POST {spec['path']}: no transcription text: {data[:200]!r}"
    return None


def models_listed(port: int) -> str | None:
    status, _, data = http_request(port, "GET", "/v1/models", timeout_s=2.0)
    if status != 200:
        return f"GET /v1/models: HTTP {status}"
    try:
        ids = [m.get("id") for m in json.loads(data).get("data", [])]
    except (ValueError, AttributeError):
        return f"GET /v1/models: not a model list: {data[:100]!r}"
    return None if MODEL in ids else f"GET /v1/models lists {ids}"


# -- targets ------------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    port: int = 0
    router_pids: Callable[[], list[int]] = list
    info: dict[str, Any] = field(default_factory=dict)
    unavailable: str | None = None


@dataclass
class Backend:
    port: int
    pid: int
    owner: str  # "bench" or "fabric agent"


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path, procs: Processes) -> None:
        self.args = args
        self.workdir = workdir
        self.procs = procs
        self.backend: Backend | None = None
        self.mesh: Any = None  # cli.localmesh.LocalMesh, imported only when needed
        self.serving_agent: Any = None
        self.targets: dict[str, Target] = {}
        self.fabric_error: str | None = None
        self.unsupported: dict[tuple[str, str], str] = {}  # (target, mode) -> the answer

    # -- backend -----------------------------------------------------------------------------
    def backend_script(self) -> str:
        return "aiohttp_backend.py" if self.args.backend == "aiohttp" else "fake_backend.py"

    def backend_argv(self, port: int) -> list[str]:
        python = sys.executable
        if self.args.backend == "aiohttp":
            try:
                venv = _venvs.ensure("aiohttp-backend", install=not self.args.no_install)
            except _venvs.VenvUnavailable as exc:
                raise SystemExit(f"bench: aiohttp backend unavailable: {exc}") from exc
            python = str(venv.python)
        script = str(BENCH_DIR / self.backend_script())
        return [python, script, "--port", str(port), "--model", MODEL]

    def wait_backend(self, port: int, timeout_s: float = 20.0) -> None:
        def check() -> str | None:
            status, _, _ = http_request(port, "GET", "/health", timeout_s=1.0)
            return None if status == 200 else f"/health: HTTP {status}"

        wait_until(check, timeout_s, f"backend on port {port}")

    def start_backend(self) -> None:
        wanted = [t for t in self.args.targets if t in FABRIC_TARGETS]
        if wanted:
            try:
                self.start_serving_agent()
                return
            except Unavailable as exc:
                self.fabric_error = str(exc)
                log(f"fabric: unavailable: {exc}; the bench starts the backend itself")
                self.stop_mesh()
        port = free_port()
        proc = self.procs.spawn("backend", self.backend_argv(port))
        try:
            self.wait_backend(port)
        except Unavailable as exc:
            tail = self.procs.log_tail("backend")
            raise SystemExit(f"bench: fake backend failed: {exc}: {tail}") from exc
        self.backend = Backend(port, proc.pid, "bench")
        log(f"backend: pid {proc.pid} on port {port}")

    def start_serving_agent(self) -> None:
        try:
            from cli.localmesh import LocalMesh
        except Exception as exc:
            raise Unavailable(f"cannot import cli.localmesh: {exc}") from exc
        self.mesh = LocalMesh(
            self.workdir / "mesh", provider="bench", log_level=self.args.fabric_log_level
        )
        self.procs.cleanups.append(self.stop_mesh)
        port = free_port()
        engine_url = f"http://127.0.0.1:{port}"
        args = ["--engine-url", engine_url, "--", *self.backend_argv(port)]
        try:
            agent = self.mesh.start("serving", args=args, timeout_s=30.0)
        except Exception as exc:
            raise Unavailable(f"serving agent did not start: {exc}") from exc
        self.serving_agent = agent
        self.wait_backend(port, 30.0)
        engine = [  # the agent's own argv names the script too: look below it only
            p
            for p in descendants(agent.pid)[1:]
            if any(a.endswith(self.backend_script()) for a in argv_of(p)[1:2])
        ]
        if not engine:
            raise Unavailable("serving agent started no engine process")
        self.procs.extra_groups.append(engine[0])  # its own session: kill its group too
        self.backend = Backend(port, engine[0], "fabric agent")
        log(f"backend: pid {engine[0]} on port {port}, engine child of agent pid {agent.pid}")

    def stop_mesh(self) -> None:
        if self.mesh is None:
            return
        mesh, self.mesh, self.serving_agent = self.mesh, None, None
        with contextlib.suppress(Exception):
            mesh.stop_all(timeout_s=5.0)
        mesh.close()

    def agent_pids(self, *agents: Any) -> Callable[[], list[int]]:
        """The agents' processes and their helpers, never the engine (nor anything below it)."""
        backend_pid = self.backend.pid if self.backend else -1

        def pids() -> list[int]:
            out: list[int] = []
            for agent in agents:
                out += descendants(agent.pid, skip=lambda p: p == backend_pid)
            return out

        return pids

    # -- targets -----------------------------------------------------------------------------
    def setup(self, name: str) -> Target:
        target = Target(name)
        started = time.monotonic()
        try:
            if name == "direct":
                assert self.backend is not None
                target.port = self.backend.port
            elif name == "vllm-router":
                self.setup_vllm_router(target)
            elif name == "litellm":
                self.setup_litellm(target)
            elif name == "trio-floor":
                self.setup_trio_floor(target)
            elif name == "fabric-1hop":
                self.setup_fabric_1hop(target)
            elif name == "fabric-2hop":
                self.setup_fabric_2hop(target)
            elif name == "fabric-sites":
                self.setup_fabric_sites(target)
            else:
                raise Unavailable("unknown target")
            target.info.update(probe_completions(target.port))
            for mode in self.args.modes:
                if mode in ("json", "sse"):
                    continue
                why = probe_mode(target.port, mode, self.args)
                if why is not None:
                    self.unsupported[(name, mode)] = why
                    log(f"{name}: unsupported for {mode}: {why}")
        except Unavailable as exc:
            target.unavailable = str(exc)
        except (OSError, http.client.HTTPException) as exc:
            target.unavailable = f"{type(exc).__name__}: {exc}"
        target.info["setup_s"] = round(time.monotonic() - started, 1)
        if target.unavailable:
            log(f"{name}: unavailable: {target.unavailable}")
        else:
            pids = target.router_pids()
            log(f"{name}: ready on port {target.port} (router pids {pids}) {target.info}")
        return target

    def venv(self, name: str, target: Target) -> _venvs.ToolVenv:
        try:
            venv = _venvs.ensure(name, install=not self.args.no_install)
        except _venvs.VenvUnavailable as exc:
            raise Unavailable(str(exc)) from exc
        target.info["version"] = venv.version
        target.info["venv"] = str(venv.path)
        target.info["venv_install_s"] = venv.install_s
        target.info["installed_now"] = venv.installed_now
        return venv

    def setup_vllm_router(self, target: Target) -> None:
        venv = self.venv("vllm-router", target)
        assert self.backend is not None
        target.port = free_port()
        backend = f"http://127.0.0.1:{self.backend.port}"
        argv = _venvs.vllm_router_argv(venv, target.port, [backend], "round_robin", free_port())
        proc = self.procs.spawn("vllm-router", argv)
        target.router_pids = lambda: descendants(proc.pid)
        self.wait_ready(target, proc, "vllm-router", 60.0)

    def setup_trio_floor(self, target: Target) -> None:
        """The least a trio + httptools relay does per request (bench/trio_floor.py)."""
        assert self.backend is not None
        target.port = free_port()
        script = str(BENCH_DIR / "trio_floor.py")
        argv = [sys.executable, script, "--port", str(target.port)]
        proc = self.procs.spawn("trio-floor", [*argv, "--upstream-port", str(self.backend.port)])
        target.router_pids = lambda: [proc.pid]
        self.wait_ready(target, proc, "trio-floor", 20.0)

    def setup_litellm(self, target: Target) -> None:
        venv = self.venv("litellm", target)
        assert self.backend is not None
        target.port = free_port()
        config = self.workdir / "litellm.yaml"
        config.write_text(
            "model_list:\n"
            f"  - model_name: {MODEL}\n"
            "    litellm_params:\n"
            f"      model: openai/{MODEL}\n"
            f"      api_base: http://127.0.0.1:{self.backend.port}/v1\n"
            "      api_key: sk-bench\n"
            "litellm_settings:\n"
            "  telemetry: false\n"
            "  drop_params: true\n"
            "  set_verbose: false\n"
            "general_settings:\n"
            "  disable_spend_logs: true\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LITELLM_", "DATABASE"))}
        env.update(
            {
                "LITELLM_TELEMETRY": "False",
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "LITELLM_LOCAL_POLICY_TEMPLATES": "true",
                "LITELLM_LOCAL_BLOG_POSTS": "true",
                "LITELLM_LOCAL_AUTOROUTER_PRESETS": "true",
                "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "true",
                "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true",
                "LITELLM_LOG": "ERROR",
                # no master key, like the other targets (no auth on the hot path)
                "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
                "DISABLE_ADMIN_UI": "True",
                "DISABLE_SCHEMA_UPDATE": "true",
                "NO_DOCS": "True",
                "NO_REDOC": "True",
                "HOME": str(self.workdir),  # anything it caches stays in the work dir
            }
        )
        argv = [
            str(venv.executable),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(target.port),
            "--num_workers",
            "1",
            "--telemetry",
            "False",
        ]
        proc = self.procs.spawn("litellm", argv, env=env)
        target.router_pids = lambda: descendants(proc.pid)
        self.wait_ready(target, proc, "litellm", 120.0)

    def wait_ready(
        self, target: Target, proc: subprocess.Popen[bytes], name: str, timeout_s: float
    ) -> None:
        def check() -> str | None:
            if proc.poll() is not None:
                tail = self.procs.log_tail(name)
                raise Unavailable(f"{name} exited with status {proc.returncode}: {tail}")
            status, _, _ = http_request(target.port, "GET", "/v1/models", timeout_s=2.0)
            return None if status == 200 else f"GET /v1/models: HTTP {status}"

        wait_until(check, timeout_s, name)

    def wait_fabric_models(self, agent: Any, timeout_s: float) -> None:
        """Until the agent's /v1/models lists the model. A /v1 answering 404 for 3 s is no
        data plane at all (a data plane answers /v1/models, possibly empty, from the start)."""
        port = int(agent.http_url.rsplit(":", 1)[1])
        first_404: list[float] = []

        def check() -> str | None:
            if not agent.running:
                raise Unavailable(f"agent {agent.name} exited: {agent.stderr_tail(1)}")
            why = models_listed(port)
            if why is not None and "HTTP 404" in why:
                first_404.append(time.monotonic())
                if first_404[-1] - first_404[0] > 3.0:
                    raise Unavailable(f"agent has no /v1 data plane ({why})")
            return why

        wait_until(check, timeout_s, f"agent {agent.name} /v1/models")

    def setup_fabric_1hop(self, target: Target) -> None:
        if self.serving_agent is None:
            raise Unavailable(self.fabric_error or "no serving agent")
        agent = self.serving_agent
        target.port = int(agent.http_url.rsplit(":", 1)[1])
        target.router_pids = self.agent_pids(agent)
        target.info["agents"] = 1
        self.wait_fabric_models(agent, self.args.fabric_timeout)

    def setup_fabric_2hop(self, target: Target) -> None:
        if self.serving_agent is None or self.mesh is None:
            raise Unavailable(self.fabric_error or "no serving agent")
        if "fabric-1hop" in self.targets and self.targets["fabric-1hop"].unavailable:
            raise Unavailable(f"serving agent: {self.targets['fabric-1hop'].unavailable}")
        try:
            ingress = self.mesh.start("ingress", timeout_s=30.0)
        except Exception as exc:
            raise Unavailable(f"ingress agent did not start: {exc}") from exc
        target.port = int(ingress.http_url.rsplit(":", 1)[1])
        target.router_pids = self.agent_pids(ingress, self.serving_agent)
        target.info["agents"] = 2
        self.wait_fabric_models(ingress, self.args.fabric_timeout)

    def setup_fabric_sites(self, target: Target) -> None:
        if self.serving_agent is None or self.mesh is None:
            raise Unavailable(self.fabric_error or "no serving agent")
        try:
            from cli.localmesh import LocalMesh
            from fabricnode.federation.keygen import generate_site_key
            from tests.support.meshview import free_port as mesh_port
            from tests.system.test_federation import gateway_args, peer_dir
        except Exception as exc:
            raise Unavailable(f"cannot import the federation helpers: {exc}") from exc
        root = self.workdir / "sites"
        root.mkdir(exist_ok=True)
        key_home = generate_site_key("default", root / "key-default")
        key_a = generate_site_key("A", root / "key-A")
        port_home, port_a = mesh_port(), mesh_port()
        peers_home, peers_a = peer_dir(root, "default", key_a), peer_dir(root, "A", key_home)
        site_a = LocalMesh(root / "site-a", provider="bench", log_level=self.args.fabric_log_level)
        self.procs.cleanups.append(lambda: (site_a.stop_all(timeout_s=5.0), site_a.close()))
        try:
            home_gw = self.mesh.start(
                "gateway-default",
                args=gateway_args(key_home, peers_home, port_home, f"A=127.0.0.1:{port_a}"),
                timeout_s=30.0,
            )
            gw_a = site_a.start(
                "gateway-a",
                args=gateway_args(key_a, peers_a, port_a, f"default=127.0.0.1:{port_home}"),
                timeout_s=30.0,
            )
        except Exception as exc:
            raise Unavailable(f"gateway did not start: {exc}") from exc
        target.port = int(gw_a.http_url.rsplit(":", 1)[1])
        target.router_pids = self.agent_pids(gw_a, home_gw, self.serving_agent)
        target.info["agents"] = 3

        def answers() -> str | None:  # once A's gateway holds the summary that lists MODEL
            body = json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
            ).encode()
            status, _, data = http_request(target.port, "POST", CHAT_PATH, body, timeout_s=5.0)
            return None if status == 200 else f"HTTP {status} {data[:120]!r}"

        wait_until(answers, self.args.fabric_timeout, "a chat answer through the gateways")


# -- measurement --------------------------------------------------------------------------------


class LoadGen:
    """The load generator process: one JSON spec in, one JSON result out, per cell."""

    def __init__(self, procs: Processes, python: str = sys.executable) -> None:
        self.proc = subprocess.Popen(
            [python, str(BENCH_DIR / "_loadgen.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(procs.workdir / "loadgen.log", "wb"),  # noqa: SIM115
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        procs.procs.append(self.proc)

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench: load generator exited ({self.proc.poll()})")
        result: dict[str, Any] = json.loads(line)
        return result


def loadgen_python(args: argparse.Namespace) -> str:
    """The aiohttp client runs in the aiohttp-backend venv (httptools and orjson are there too)."""
    if args.client != "aiohttp":
        return sys.executable
    try:
        return str(_venvs.ensure("aiohttp-backend", install=not args.no_install).python)
    except _venvs.VenvUnavailable as exc:
        raise SystemExit(f"bench: aiohttp client unavailable: {exc}") from exc


def measure(
    bench: Bench, loadgen: LoadGen, targets: list[Target], cells: list[Cell]
) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Every round: every cell, every target in turn. Returns per (target, cell) round results."""
    args = bench.args
    backend = bench.backend
    assert backend is not None
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}

    def bystanders(target: Target) -> list[int]:
        mine = set(target.router_pids())
        pids = {p for t in targets if t is not target for p in t.router_pids()}
        return sorted(pids - mine)

    for rnd in range(args.rounds):
        shift = rnd % len(targets)
        order = targets[shift:] + targets[:shift]
        for cell in cells:
            for target in order:
                if (target.name, cell.mode) in bench.unsupported:
                    continue
                spec = {
                    "host": "127.0.0.1",
                    "port": target.port,
                    **mode_spec(cell.mode, args),
                    "concurrency": cell.concurrency,
                    "warmup_s": args.warmup,
                    "seconds": args.seconds,
                    "client": args.client,
                    "drain_s": 3.0,
                    "cpu_groups": {
                        "router": target.router_pids(),
                        "backend": [backend.pid],
                        # the other targets' routers, idle meanwhile: do they burn CPU?
                        "bystanders": bystanders(target),
                    },
                }
                res = loadgen.run(spec)
                res["round"] = rnd
                results.setdefault((target.name, cell.label), []).append(res)
                lat = res.get("latencies_us") or []
                log(
                    f"round {rnd + 1}/{args.rounds} {cell.label:<9} {target.name:<12} "
                    f"{res.get('completed', 0):>6} req, mean {mean(lat) / 1000:.3f} ms, "
                    f"errors {res.get('errors', res.get('fatal'))}"
                )
    return results


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Added latency and CPU of routers in front of one fake backend.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--targets", default=",".join(ALL_TARGETS), help="comma-separated targets")
    p.add_argument("--seconds", type=float, default=2.0, help="recorded seconds per cell")
    p.add_argument("--warmup", type=float, default=0.5, help="unrecorded seconds before each")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", default="1,32", help="comma-separated client counts")
    p.add_argument(
        "--modes",
        default="json,sse",
        help="comma-separated: json, sse (chat completions), audio (multipart transcription "
        "upload), responses-sse (streamed Responses)",
    )
    p.add_argument("--prompt-bytes", type=int, default=2000)
    p.add_argument("--audio-bytes", type=int, default=65536, help="WAV file size, audio mode")
    p.add_argument(
        "--client",
        choices=("protocol", "aiohttp"),
        default="protocol",
        help="protocol: asyncio protocols + httptools, nearly free; aiohttp: closed-loop "
        "aiohttp.ClientSession clients (with --backend aiohttp: the notes' setup)",
    )
    p.add_argument(
        "--backend",
        choices=("fast", "aiohttp"),
        default="fast",
        help="fast: bench/fake_backend.py (0.03 ms/request, router CPU is everything); aiohttp: "
        "bench/aiohttp_backend.py, the notes' and the issue's reference setup",
    )
    p.add_argument("--quick", action="store_true", help="tiny smoke run (1 round, short cells)")
    p.add_argument("--json", metavar="PATH", help="write every figure (and raw rounds) here")
    p.add_argument("--no-install", action="store_true", help="never install a router's venv")
    p.add_argument("--fabric-timeout", type=float, default=30.0, help="s for agents to serve")
    p.add_argument("--fabric-log-level", default="warning")
    p.add_argument("--keep-workdir", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = min(args.seconds, 0.4)
        args.warmup = min(args.warmup, 0.15)
        args.rounds = 1
        args.fabric_timeout = min(args.fabric_timeout, 15.0)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in ALL_TARGETS]
    if unknown:
        p.error(f"unknown targets {unknown}; choose from {', '.join(ALL_TARGETS)}")
    if "direct" not in targets:
        targets.insert(0, "direct")  # the baseline every "added" figure needs
    args.targets = targets
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes takes some of {', '.join(MODES)}")
    if args.backend == "aiohttp" and any(m not in ("json", "sse") for m in modes):
        p.error("--backend aiohttp serves chat completions only: --modes json,sse")
    args.modes = modes
    return args


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP end the bench like Ctrl-C does, so every cleanup runs. SIGINT is
    handled too, even where it was inherited as ignored (a background job of a script)."""

    def handler(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {
        sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cells = [Cell(c, mode) for c in args.concurrency for mode in args.modes]
    workdir = Path(tempfile.mkdtemp(prefix="fabric-bench-router-"))
    procs = Processes(workdir)
    started = time.monotonic()
    try:
        with signals_raise():
            bench = Bench(args, workdir, procs)
            bench.start_backend()
            targets = []
            for name in args.targets:
                target = bench.setup(name)
                bench.targets[name] = target
                targets.append(target)
            live = [t for t in targets if not t.unavailable]
            if not any(t.name == "direct" for t in live):
                raise SystemExit("bench: the direct baseline is not available")
            loadgen = LoadGen(procs, loadgen_python(args))
            steal0 = cpu_steal()
            raw = measure(bench, loadgen, live, cells)
            steal1 = cpu_steal()
            rss = {t.name: round(rss_mb(t.router_pids()), 1) for t in live if t.name != "direct"}
            summary = summarize(live, cells, raw, bench.unsupported)
            steal_pct = 100.0 * (steal1[0] - steal0[0]) / max(1, steal1[1] - steal0[1])
            others = median([others_pct(r) for runs in raw.values() for r in runs])
            idle = median([bystanders_pct(r) for runs in raw.values() for r in runs])
            assert bench.backend is not None
            header = [
                f"bench/router: {len(live)} targets, cells {', '.join(c.label for c in cells)}, "
                f"{args.rounds} round(s) x {args.seconds:g} s (+{args.warmup:g} s warm-up), "
                f"{args.prompt_bytes}-byte prompts",
                f"host: {os.cpu_count()} cpus, {platform.python_implementation()} "
                f"{platform.python_version()}, steal {steal_pct:.1f}% during the run, "
                f"other processes {fmt(others, 0)}% and idle targets {fmt(idle, 0)}% of all "
                f"CPUs in a median window; "
                f"client {args.client}, "
                f"backend {args.backend} ({bench.backend_script()}) pid {bench.backend.pid} "
                f"(started by {bench.backend.owner})",
            ]
            for t in live:
                if t.name == "direct":
                    continue
                bits = [f"{k}={v}" for k, v in t.info.items() if k in ("version", "agents")]
                if "venv_install_s" in t.info:
                    bits.append(f"venv install {t.info['venv_install_s']:.0f} s")
                bits.append(f"RSS {rss.get(t.name, 0):.0f} MB")
                if t.name in FABRIC_TARGETS:  # agents run from this tree with this environment
                    bits.append(f"data plane {native.status}")
                header.append(f"{t.name}: {', '.join(bits)}")
            print(render(targets, cells, summary, header), end="", flush=True)
            if args.json:
                doc = {
                    "args": {k: v for k, v in vars(args).items()},
                    "cells": [c.label for c in cells],
                    "unsupported": {f"{t} {m}": why for (t, m), why in bench.unsupported.items()},
                    "steal_pct": steal_pct,
                    "others_cpu_pct_median": others,
                    "idle_targets_cpu_pct_median": idle,
                    "duration_s": time.monotonic() - started,
                    "targets": {
                        t.name: {
                            "unavailable": t.unavailable,
                            "info": t.info,
                            "rss_mb": rss.get(t.name),
                            "cells": summary.get(t.name),
                        }
                        for t in targets
                    },
                    "raw": {
                        f"{name} {label}": [
                            {k: v for k, v in r.items() if k not in ("latencies_us", "ttft_us")}
                            for r in runs
                        ]
                        for (name, label), runs in raw.items()
                    },
                }
                Path(args.json).write_text(json.dumps(finite(doc), indent=1, default=str) + "\n")
                log(f"wrote {args.json}")
            return 0
    except KeyboardInterrupt:
        log("interrupted; stopping every process it started")
        return 130
    finally:
        procs.close()
        if args.keep_workdir:
            log(f"work files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
