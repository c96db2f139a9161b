"""Failover on real agents: crashes and graceful leaves under load give no client errors for
requests that had not started streaming, and a stream broken mid-way ends with an error event."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
from meshview import free_port

from fabricnode.localmesh import AgentProcess, LocalMesh, wait_until

pytestmark = pytest.mark.slow


def sim_engine_args(model: str, gpu: str, *extra: str) -> list[str]:
    """``fabric start`` arguments that supervise a simulated engine with extra engine flags."""
    port = free_port()
    return [
        "--sim-gpu",
        gpu,
        "--engine-url",
        f"http://127.0.0.1:{port}",
        "--",
        sys.executable,
        "-m",
        "fabricnode.simengine",
        "--model",
        model,
        "--port",
        str(port),
        "--gpu",
        gpu,
        *extra,
    ]


def serving_count(ingress: AgentProcess, model: str) -> int:
    try:
        r = httpx.get(ingress.http_url + "/v1/models", timeout=2)
        return sum(m["fabric_nodes"] for m in r.json()["data"] if m["id"] == model)
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def run_load(
    url: str, clients: int, stop: threading.Event, body: Callable[[int], dict[str, object]]
) -> Counter[str]:
    """Closed-loop non-streaming clients; counts outcomes by status (or exception name)."""
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()

    def client(n: int) -> None:
        with httpx.Client(timeout=30) as http:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    r = http.post(url + "/v1/chat/completions", json=body(n * 100000 + i))
                    key = str(r.status_code)
                except httpx.HTTPError as exc:
                    key = type(exc).__name__
                with lock:
                    outcomes[key] += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(30)
    return outcomes


def chat(i: int) -> dict[str, object]:
    return {
        "model": "m1",
        "messages": [{"role": "user", "content": f"request {i} " + "lorem ipsum " * 20}],
        "max_tokens": 16,
    }


def test_crash_and_leave_under_load_give_no_client_errors(mesh: LocalMesh) -> None:
    ingress = mesh.start("ingress")
    nodes = [
        mesh.start(f"s{i}", args=sim_engine_args("m1", "H100", "--slowdown", "30"))
        for i in range(4)
    ]
    assert wait_until(lambda: serving_count(ingress, "m1") == 4, 30)
    stop = threading.Event()
    result: list[Counter[str]] = []
    loader = threading.Thread(
        target=lambda: result.append(run_load(ingress.http_url, 8, stop, chat))
    )
    loader.start()
    try:
        time.sleep(1.5)
        nodes[0].kill()  # crash: in-flight requests to it must fail over
        time.sleep(1.5)
        nodes[1].terminate()  # graceful leave: refuses new forwards, finishes the rest
        time.sleep(2.0)
    finally:
        stop.set()
        loader.join(60)
    outcomes = result[0]
    print("outcomes", dict(outcomes))
    assert outcomes["200"] > 20
    assert set(outcomes) == {"200"}, outcomes
    assert nodes[1].wait(15) == 0
    metrics = httpx.get(ingress.http_url + "/metrics").text
    assert "fabric_ingress_retries_total" in metrics


def test_stream_broken_mid_way_ends_with_an_error_event(mesh: LocalMesh) -> None:
    ingress = mesh.start("ingress")
    node = mesh.start("s", args=sim_engine_args("m1", "H100", "--slowdown", "200"))
    assert wait_until(lambda: serving_count(ingress, "m1") == 1, 30)
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": "tell a long story"}],
        "max_tokens": 400,
        "stream": True,
    }
    events: list[str] = []
    with httpx.stream(
        "POST", ingress.http_url + "/v1/chat/completions", json=body, timeout=30
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                node.signal(signal.SIGKILL)  # the serving agent dies mid-stream
    # httpx read the stream to a clean end (a well-formed terminating chunk, no exception).
    assert len(events) >= 3
    last = json.loads(events[-1])
    assert "error" in last and last["error"]["code"] == "upstream_broken"
    assert "[DONE]" not in events


def test_request_to_a_node_that_goes_down_fails_over_before_the_first_byte(
    mesh: LocalMesh,
) -> None:
    """A non-streamed request waiting on an engine that hangs is moved once the node is DOWN."""
    ingress = mesh.start("ingress")
    hung = mesh.start(
        "hung", args=sim_engine_args("m1", "H100", "--hang-after-s", "3", "--slowdown", "5")
    )
    assert wait_until(lambda: serving_count(ingress, "m1") == 1, 30)
    healthy = mesh.start("healthy", args=sim_engine_args("m1", "L40S"))
    assert wait_until(lambda: serving_count(ingress, "m1") == 2, 30)
    # Wait for the hang; requests that land on the hung node must still be answered.
    time.sleep(max(0.0, 3.5))
    served: Counter[str] = Counter()
    for i in range(6):
        r = httpx.post(ingress.http_url + "/v1/chat/completions", json=chat(i), timeout=30)
        assert r.status_code == 200, r.text
        served[r.headers["x-fabric-node"]] += 1
    assert served[healthy.session_id] == 6
    assert hung.running  # the agent itself is fine; its engine was declared DOWN
