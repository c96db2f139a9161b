"""Failover on real agents: crashes and graceful leaves under load give no client errors for
requests that had not started streaming, and a stream broken mid-way ends with an error event."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import threading
import time
from collections import Counter
from urllib.parse import urlsplit

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from tests.support.meshload import engine_process, run_load, serving_count, sim_engine_args

pytestmark = pytest.mark.slow


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


def open_stream(
    ingress: AgentProcess, content: str, max_tokens: int
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed chat request on one http.client connection, its response head read (200)."""
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    url = urlsplit(ingress.http_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"}
    )
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


def test_stream_broken_mid_way_ends_with_an_error_event(mesh: LocalMesh) -> None:
    ingress = mesh.start("ingress")
    node = mesh.start("s", args=sim_engine_args("m1", "H100", "--slowdown", "200"))
    assert wait_until(lambda: serving_count(ingress, "m1") == 1, 30)
    # http.client on one connection: it reconnects only when a response said it would close,
    # so the follow-up request below shows the connection survived the broken stream.
    conn, r = open_stream(ingress, "tell a long story", 400)
    assert not r.will_close
    events: list[str] = []
    while line := r.readline():  # de-chunked by http.client; b"" at a clean end
        text = line.decode().strip()
        if not text.startswith("data: "):
            continue
        events.append(text[6:])
        if len(events) == 3:
            node.signal(signal.SIGKILL)  # the serving agent dies mid-stream
    # A well-formed end: the terminating chunk arrived (http.client raises otherwise).
    assert len(events) >= 3
    last = json.loads(events[-1])
    assert "error" in last and last["error"]["code"] == "upstream_broken"
    assert "[DONE]" not in events
    # The response was complete, so the client may reuse the connection at once.
    sock = conn.sock
    conn.request("GET", "/v1/models")
    again = conn.getresponse()
    assert again.status == 200 and conn.sock is sock
    again.read()
    conn.close()


def test_request_to_a_node_that_goes_down_fails_over_before_the_first_byte(
    mesh: LocalMesh,
) -> None:
    """A non-streamed request waiting on an engine that hangs is moved once the node is DOWN."""
    ingress = mesh.start("ingress")
    hung = mesh.start("hung", args=sim_engine_args("m1", "H100", "--slowdown", "5"))
    healthy = mesh.start("healthy", args=sim_engine_args("m1", "L40S"))
    assert wait_until(lambda: serving_count(ingress, "m1") == 2, 30)
    # The engine hangs when the test says so, not on a timer that a slow start could outrun
    # (with --hang-after-s the hung node could be DOWN before the other one served). Stopped,
    # it accepts nothing and answers nothing (the agent's listening socket still queues
    # connections): requests that land on it before it is declared DOWN must still be answered.
    engine = engine_process(hung)
    assert engine is not None
    os.kill(engine.pid, signal.SIGSTOP)
    served: Counter[str] = Counter()
    try:
        for i in range(6):
            r = httpx.post(ingress.http_url + "/v1/chat/completions", json=chat(i), timeout=30)
            assert r.status_code == 200, r.text
            served[r.headers["x-fabric-node"]] += 1
    finally:
        with contextlib.suppress(ProcessLookupError):  # stopped by its agent by now
            os.kill(engine.pid, signal.SIGCONT)
    assert served[healthy.session_id] == 6
    assert hung.running  # the agent itself is fine; its engine was declared DOWN


def test_ingress_leaving_mid_stream_lets_the_stream_finish(mesh: LocalMesh) -> None:
    """SIGTERM on the ingress: a stream it is relaying ends normally within the shutdown grace."""
    ingress = mesh.start("ingress")
    node = mesh.start("s", args=sim_engine_args("m1", "H100", "--slowdown", "30"))
    assert wait_until(lambda: serving_count(ingress, "m1") == 1, 30)
    # 30 tokens take about 2.5 s: longer than the leave linger (1 s), within the grace (2 s).
    conn, r = open_stream(ingress, "tell a story", 30)
    events: list[str] = []
    started = time.monotonic()
    while line := r.readline():
        text = line.decode().strip()
        if text.startswith("data: "):
            events.append(text[6:])
            if len(events) == 3:
                ingress.terminate()
    took = time.monotonic() - started
    print(f"{len(events)} events in {took:.2f} s")
    assert events[-1] == "[DONE]", events[-3:]
    assert not any("error" in e for e in events[:-1] if e.startswith("{"))
    # Still going when the ingress closed its doors (after the 1 s linger).
    assert took > 1.5
    conn.close()
    assert ingress.wait(15) == 0
    assert node.running
