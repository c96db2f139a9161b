"""Many unfinished uploads cannot grow a real agent past its body budget, and none of it leaks.

Before the budget, 24 connections each holding an unfinished 16 MiB body grew an agent by
384 MB, still held after they closed (each connection's parser sits in a reference cycle, so its
buffers waited for a full garbage collection); six rounds of such uploads took one to 1.8 GB.
Now the bodies of all connections share one budget (512 MiB: past it a request gets 503 and its
connection closes), and a closed connection's buffers go at once.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from cli.localmesh import LocalMesh

pytestmark = pytest.mark.slow

MIB = 1024 * 1024
BODY = 16 * MIB  # the default --max-body-mb
CONNECTIONS = 48  # 768 MiB of bodies offered per wave, over the 512 MiB budget
BUDGET = 512 * MIB
SLACK = 160 * MIB  # the interpreter, socket buffers, allocator slack


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def unfinished_uploads(host: str, port: int) -> list[socket.socket]:
    """CONNECTIONS connections that each send all of a 16 MiB body but its last byte."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % BODY
    )
    chunk = b"x" * MIB
    held = []
    for _ in range(CONNECTIONS):
        sock = socket.create_connection((host, port), timeout=30)
        held.append(sock)
        try:
            sock.sendall(head)
            for _ in range(BODY // MIB - 1):
                sock.sendall(chunk)
            sock.sendall(chunk[:-1])
        except OSError:
            pass  # refused over the budget: the agent answered 503 and closed
    return held


def test_unfinished_uploads_stay_within_the_body_budget_and_do_not_leak(mesh: LocalMesh) -> None:
    agent = mesh.start("ingress")
    host, port = agent.http_url.removeprefix("http://").rsplit(":", 1)
    baseline = rss(agent.pid)
    peaks = []
    for _wave in range(2):
        held = unfinished_uploads(host, int(port))
        time.sleep(0.5)  # the agent reads what was sent
        peaks.append(rss(agent.pid))
        # Legitimate traffic is served meanwhile.
        assert httpx.get(f"{agent.http_url}/v1/models", timeout=10).status_code == 200
        for sock in held:
            sock.close()
    metrics = httpx.get(f"{agent.http_url}/metrics", timeout=10).text
    refused = [
        line
        for line in metrics.splitlines()
        if line.startswith('fabric_ingress_malformed_total{status="503"}')
    ]
    assert refused and float(refused[0].split()[-1]) > 0, "the budget never refused a body"
    assert agent.running
    print(
        f"\nRSS baseline {baseline / MIB:.0f} MiB, after wave 1 {peaks[0] / MIB:.0f} MiB, "
        f"after wave 2 {peaks[1] / MIB:.0f} MiB"
    )
    assert peaks[0] - baseline <= BUDGET + SLACK, peaks
    # What the first wave held came back: the second wave reuses it instead of growing.
    assert peaks[1] - baseline <= BUDGET + SLACK, peaks
    assert peaks[1] <= peaks[0] + SLACK, peaks
