"""What two-layer routing's tests send and check with real agents: a burst of clients beyond the
replicas of one site, conversations, and the request logs that say where each request was
served. On loopback (tests/system/test_push_across_sites.py) and over the emulated WAN
(tests/sites/test_push_wan.py), where every client runs inside a node's namespace (``run``)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from cli.localmesh import wait_until
from tests.system.test_cross_site import log_lines

T = TypeVar("T")
Runner = Callable[[Callable[[], Any]], Any]


def here(fn: Callable[[], T]) -> T:
    """Run a client in this process's own network (loopback)."""
    return fn()


def turns(
    url: str, model: str, session: str, n: int, home: str, run: Runner = here
) -> list[tuple[str, str]]:
    """A conversation of ``n`` turns at the ingress ``url``: (site, node) of each answer (the
    ingress's own site, ``home``, when the answer carries no ``X-Fabric-Site``)."""

    def talk() -> list[tuple[str, str]]:
        out = []
        messages: list[dict[str, str]] = []
        with httpx.Client(timeout=60, headers={"x-session-id": session}) as http:
            for t in range(n):
                messages.append({"role": "user", "content": f"{session} turn {t}"})
                body = {"model": model, "messages": messages, "max_tokens": 8}
                r = http.post(f"{url}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                reply = r.json()["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": reply})
                out.append((r.headers.get("x-fabric-site", home), r.headers["x-fabric-node"]))
        return out

    answered: list[tuple[str, str]] = run(talk)
    return answered


@dataclass
class Burst:
    """What a burst got: status codes, the site that served each answer, and the turns of the
    conversation that began once the burst spilled over."""

    results: Counter[str] = field(default_factory=Counter)
    served_at: Counter[str] = field(default_factory=Counter)
    busy: list[tuple[str, str]] = field(default_factory=list)


def burst(
    url: str,
    model: str,
    *,
    clients: int,
    per_client: int,
    home: str,
    run: Runner = here,
    conversation_turns: int = 5,
    timeout_s: float = 120.0,
) -> Burst:
    """``clients`` closed-loop clients, ``per_client`` requests each, at the ingress ``url``; and
    a conversation of ``conversation_turns`` that begins once an answer came from another site
    than ``home`` (the burst spilled over)."""
    out = Burst()
    lock = threading.Lock()
    spilling = threading.Event()

    def client(i: int) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"client {i}: tell me a story"}],
            "max_tokens": 24,
        }
        with httpx.Client(timeout=60) as http:
            for _ in range(per_client):
                r = http.post(f"{url}/v1/chat/completions", json=body)
                with lock:
                    out.results[str(r.status_code)] += 1
                    if r.status_code == 200:
                        site = r.headers.get("x-fabric-site", home)
                        out.served_at[site] += 1
                        if site != home:
                            spilling.set()

    def conversation() -> None:
        if spilling.wait(60):
            out.busy.extend(turns(url, model, "busy", conversation_turns, home, run))

    threads = [threading.Thread(target=run, args=(lambda i=i: client(i),)) for i in range(clients)]
    threads.append(threading.Thread(target=conversation))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return out


def check_request_logs(
    ingress_log: Path, gateway_logs: dict[str, Path], expected: int, timeout_s: float = 10.0
) -> Counter[str]:
    """Each request crossed between sites at most once: what the ingress's log says was served
    at each peer site is exactly what that site's gateway took in, each served in its own site
    (none went on to a third). Each agent writes its line when it has settled the request (its
    own time): read once every one of the ``expected`` lines is there. The ingress's count by
    site."""

    def at_ingress() -> Counter[str]:
        return Counter(r["site"] for r in log_lines(ingress_log))

    def settled() -> bool:
        at = at_ingress()
        if sum(at.values()) != expected:
            return False
        return all(len(log_lines(log)) >= at[s] for s, log in gateway_logs.items())

    assert wait_until(settled, timeout_s), at_ingress()
    at = at_ingress()
    for s, log in gateway_logs.items():
        lines = log_lines(log)
        assert {r["site"] for r in lines} <= {s}, lines[:3]
        assert len(lines) == at[s], (s, len(lines), at)
    return at
