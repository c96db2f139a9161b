"""A busy engine is not a dead one (``engine.liveness``), on real agents and simulated engines.

One ``/v1/messages/count_tokens`` request with a 15 MiB prompt of punctuation holds a simulated
engine's event loop for seconds (it tokenizes on the loop), so its ``/health`` goes unanswered;
an 8 MB chat prompt sent meanwhile does the same to whichever node takes it. Before, each agent
took three missed health checks for a death, stopped its engine and marked the node DOWN; the
ingress failed the request over, and it took the next node down too: the model had no replica
left and the client got a 503. Now both engines keep using CPU, so both agents call them busy,
keep them SERVING, and the clients get their answers.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until

pytestmark = pytest.mark.slow

MODEL = "m1"
MIB = 1024 * 1024


def states(agent: AgentProcess) -> dict[str, str]:
    nodes = httpx.get(f"{agent.http_url}/fabric/v1/nodes", timeout=5).json()["nodes"]
    return {n["session_id"]: f"{n['state']}/{n['liveness']}" for n in nodes}


def test_a_busy_engine_stays_serving_and_the_requests_that_keep_it_busy_are_answered(
    mesh: LocalMesh,
) -> None:
    a = mesh.start("a", args=["--sim", MODEL])
    b = mesh.start("b", args=["--sim", MODEL])
    both = {a.session_id, b.session_id}
    serving = dict.fromkeys(both, "serving/alive")
    assert wait_until(lambda: states(a) == serving and states(b) == serving, 30)

    answers: dict[str, httpx.Response | Exception] = {}

    def send(name: str, path: str, body: dict[str, object]) -> None:
        try:
            answers[name] = httpx.post(a.http_url + path, json=body, timeout=300)
        except httpx.HTTPError as exc:
            answers[name] = exc

    count = {"model": MODEL, "messages": [{"role": "user", "content": "!" * (15 * MIB)}]}
    chat = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "? " * (4 * MIB)}],
    }
    senders = [
        threading.Thread(target=send, args=("count", "/v1/messages/count_tokens", count)),
        threading.Thread(target=send, args=("chat", "/v1/chat/completions", chat)),
    ]
    for sender in senders:
        sender.start()
    seen: list[dict[str, str]] = []
    while any(s.is_alive() for s in senders):
        seen.append(states(b))  # b's view of both nodes, while the engines are busy
        time.sleep(0.5)
    for sender in senders:
        sender.join()

    # No node was lost: every look saw both SERVING (b's own engine may be the busy one, and
    # its view of a is what the ingress on b would route by).
    assert seen and all(
        {k: v.split("/")[0] for k, v in s.items()} == dict.fromkeys(both, "serving") for s in seen
    ), seen
    for name, got in answers.items():
        assert isinstance(got, httpx.Response), (name, got)
        assert got.status_code == 200 or 400 <= got.status_code < 500, (name, got.text[:300])
    count_answer = answers["count"]
    assert isinstance(count_answer, httpx.Response) and count_answer.status_code == 200
    assert count_answer.json()["input_tokens"] > 15 * MIB // 2
    # The scenario happened: an agent found its engine busy and said so, and stopped nothing.
    logs = a.stderr_tail(400) + b.stderr_tail(400)
    assert "busy, not dead" in logs, logs[-3000:]
    assert "engine hung" not in logs and "announcing DOWN" not in logs
    assert wait_until(lambda: states(a) == serving and states(b) == serving, 30)
