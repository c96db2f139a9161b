"""Helpers for tests that put real agents under load: simulated engines, closed-loop clients,
and the processes behind an agent (its engine child; what is left of a mesh after a test).

Process facts come from ``/proc`` (Linux, as the agent's parent-death signal is): a pid is named
together with its start time, so a recycled pid is never mistaken for the process we started.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import httpx

from cli.localmesh import AgentProcess

R = TypeVar("R")


def sim_engine_args(model: str, gpu: str, *extra: str) -> list[str]:
    """``fabric start`` arguments that supervise a simulated engine with extra engine flags (the
    agent binds the engine's port itself: no port is chosen here that another process could take
    before the engine binds it)."""
    args = ["--sim", model, "--sim-gpu", gpu]
    return [*args, "--sim-args", shlex.join(extra)] if extra else args


def serving_count(ingress: AgentProcess, model: str) -> int:
    """How many nodes serve ``model`` as ``ingress``'s ``/v1/models`` says (-1: no answer)."""
    try:
        r = httpx.get(ingress.http_url + "/v1/models", timeout=2)
        return sum(m["fabric_nodes"] for m in r.json()["data"] if m["id"] == model)
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def closed_loop(workers: Sequence[Callable[[int], R]], stop: threading.Event) -> list[R]:
    """Closed-loop load: each worker runs in its own thread and is called with 1, 2, 3, ...
    (each call is one request) until ``stop`` is set; returns every result, in no order.

    Blocks until ``stop`` is set and every worker has finished its last call. Workers bound
    their own calls (client timeouts), so a thread that does not finish is a hang; that and a
    worker that raised are a RuntimeError (from the worker's exception).
    """
    results: list[R] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def loop(worker: Callable[[int], R]) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                result = worker(i)
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                return
            with lock:
                results.append(result)

    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(120)
    hung = sum(t.is_alive() for t in threads)
    if hung:
        raise RuntimeError(f"{hung} load threads still busy 120 s after the stop")
    if errors:
        raise RuntimeError(f"{len(errors)} load workers failed") from errors[0]
    with lock:
        return list(results)


def run_load(
    url: str, clients: int, stop: threading.Event, body: Callable[[int], dict[str, object]]
) -> Counter[str]:
    """Closed-loop non-streaming clients; counts outcomes by status (or exception name)."""
    with httpx.Client(timeout=30) as http:

        def client(n: int) -> Callable[[int], str]:
            def post(i: int) -> str:
                try:
                    r = http.post(url + "/v1/chat/completions", json=body(n * 100000 + i))
                    return str(r.status_code)
                except httpx.HTTPError as exc:
                    return type(exc).__name__

            return post

        return Counter(closed_loop([client(n) for n in range(clients)], stop))


# -- streams -------------------------------------------------------------------------------


@dataclass
class Stream:
    """One streamed chat answer as the client saw it."""

    status: int = 0
    node: str = ""
    words: int = 0
    done: bool = False  # ended with [DONE]
    errors: list[str] = field(default_factory=list)


def stream_chat(
    url: str,
    model: str,
    i: int,
    max_tokens: int,
    started: threading.Semaphore,
    headers: dict[str, str] | None = None,
) -> Stream:
    """One streamed chat request to ``url`` (with ``headers``: ``X-Fabric-Require`` ...);
    ``started`` is released at its first event (or when it failed before one)."""
    out = Stream()
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"tell story number {i}"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    text: list[str] = []
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"content-type": "application/json", **(headers or {})},
        )
        r = conn.getresponse()
        out.status, out.node = r.status, r.getheader("x-fabric-node") or ""
        first = True
        while line := r.readline():
            data = line.decode().strip()
            if not data.startswith("data: "):
                continue
            if first:
                started.release()
                first = False
            if data == "data: [DONE]":
                out.done = True
                continue
            event = json.loads(data[6:])
            if "error" in event:
                out.errors.append(str(event["error"]))
            elif event.get("choices"):
                text.append(event["choices"][0]["delta"].get("content") or "")
    except (OSError, http.client.HTTPException) as exc:
        out.errors.append(repr(exc))
    finally:
        conn.close()
        started.release()  # also when it failed before its first event: the test goes on
    out.words = len("".join(text).split())
    return out


def run_streams(
    urls: list[str], model: str, max_tokens: int, headers: dict[str, str] | None = None
) -> tuple[list[threading.Thread], list[Stream]]:
    """One streamed chat request to each of ``urls``, each in a thread; returns once every one
    has its first event (join the threads, then read the results)."""
    results: list[Stream] = [Stream() for _ in urls]
    started = threading.Semaphore(0)

    def one(i: int) -> None:
        results[i] = stream_chat(urls[i], model, i, max_tokens, started, headers)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(urls))]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=30), "a stream did not start"
    return threads, results


# -- processes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pid:
    """One process, named by pid and start time (clock ticks since boot)."""

    pid: int
    started: int

    @classmethod
    def of(cls, pid: int) -> Pid | None:
        stat = _stat(pid)
        return None if stat is None else cls(pid, int(stat[19]))

    def running(self) -> bool:
        """Still there and not a zombie (a zombie has exited; only its parent has to reap it)."""
        stat = _stat(self.pid)
        return stat is not None and int(stat[19]) == self.started and stat[0] != "Z"


def _stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name: [0] state ... [19] start time."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (whichever of its threads forked them)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out.extend(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except OSError:
            continue
    return out


def engine_process(agent: AgentProcess) -> Pid | None:
    """The simulated engine ``agent`` supervises right now (None while there is none)."""
    for child in children(agent.pid):
        if "fabricnode.simengine" in _cmdline(child):
            found = Pid.of(child)
            if found is not None and found.running():
                return found
    return None


def processes_of(workdir: Path) -> Iterator[Pid]:
    """Running processes whose environment has ``FABRIC_HOME=workdir``: the agents of that
    ``LocalMesh`` and everything they started (engines inherit the agent's environment)."""
    marker = b"FABRIC_HOME=" + os.fsencode(workdir)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found = Pid.of(int(name))
            if found is not None and found.running():
                yield found
