"""A stream whose serving node dies mid-answer continues on another node: real agents, the
simulated engine (slowed so a 60-token answer takes about two seconds), ``kill -9``.

Each test starts its own mesh: ``c``, an ingress without an engine, and serving nodes of m1.
The client reads part of the answer, the node serving it is killed, and the client must get one
well-formed answer: one id, one role chunk, every token once (``max_tokens`` content chunks, as
the simulated engine writes one per token), one final chunk, and usage that counts the whole
answer once, the same prompt tokens as an unbroken request.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import httpx
import openai
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from tests.support.meshload import engine_process
from tests.support.meshview import metrics

pytestmark = pytest.mark.slow

MODEL = "m1"
TOKENS = 60
KILL_AFTER = 10  # content chunks read before the serving node is killed
SLOW = ["--sim", MODEL, "--sim-gpu", "H100", "--sim-args", "--slowdown 10"]
MESSAGES = [{"role": "user", "content": "tell me a long story about resumable streams"}]


class Mesh:
    def __init__(self, local: LocalMesh, ingress: AgentProcess, servers: list[AgentProcess]):
        self.local, self.ingress, self.servers = local, ingress, servers

    def by_session(self, sid: str) -> AgentProcess:
        (found,) = [s for s in self.servers if s.session_id == sid]
        return found

    def client(self, agent: AgentProcess | None = None) -> openai.OpenAI:
        url = (agent or self.ingress).http_url
        return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def resumes(self, outcome: str, agent: AgentProcess | None = None) -> float:
        m = metrics((agent or self.ingress).http_url)
        return m.get(f'fabric_ingress_stream_resumes_total{{outcome="{outcome}"}}', 0.0)


def models_listed(agent: AgentProcess) -> int:
    """How many nodes serve the model, as ``agent``'s ``/v1/models`` says (0: none, no answer)."""
    try:
        data = httpx.get(agent.http_url + "/v1/models", timeout=2).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(m["fabric_nodes"] for m in data if m["id"] == MODEL)


def start_mesh(local: LocalMesh, servers: int) -> Mesh:
    ingress = local.start("c")
    nodes = [local.start(f"s{i}", args=SLOW) for i in range(servers)]
    assert wait_until(lambda: models_listed(ingress) == servers, 30), "not every node serves"
    return Mesh(local, ingress, nodes)


def unbroken_prompt_tokens(mesh: Mesh, headers: dict[str, str] | None = None) -> int:
    answer = mesh.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, extra_headers=headers
    )
    assert answer.usage is not None
    return answer.usage.prompt_tokens


def read_with_a_kill(
    mesh: Mesh,
    kill: Any,
    agent: AgentProcess | None = None,
    headers: dict[str, str] | None = None,
) -> list[Any]:
    """Stream an answer through ``agent`` (the ingress), calling ``kill(serving session)``
    after ``KILL_AFTER`` content chunks; every chunk the openai client yields."""
    raw = mesh.client(agent).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=headers,
    )
    serving = raw.headers["x-fabric-node"]
    chunks: list[Any] = []
    contents = 0
    for chunk in raw.parse():
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            contents += 1
            if contents == KILL_AFTER:
                kill(serving)
    return chunks


def assert_one_whole_answer(chunks: list[Any], prompt_tokens: int) -> None:
    assert len({c.id for c in chunks}) == 1, "one id for the whole answer"
    with_choices = [c for c in chunks if c.choices]
    roles = [c for c in with_choices if c.choices[0].delta.role]
    assert len(roles) == 1 and with_choices[0] is roles[0], "one role chunk, first"
    contents = [c.choices[0].delta.content for c in with_choices if c.choices[0].delta.content]
    assert len(contents) == TOKENS, "every token once: none lost, none repeated"
    finals = [c for c in with_choices if c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] is with_choices[-1]
    assert finals[0].choices[0].finish_reason == "length"
    assert all(c.choices[0].index == 0 for c in with_choices)
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.completion_tokens == TOKENS
    assert usage.prompt_tokens == prompt_tokens
    assert usage.total_tokens == prompt_tokens + TOKENS


def test_a_stream_whose_node_is_killed_continues_on_another_node(mesh: LocalMesh) -> None:
    fab = start_mesh(mesh, 2)
    prompt_tokens = unbroken_prompt_tokens(fab)
    killed: list[str] = []

    def kill(sid: str) -> None:
        killed.append(sid)
        fab.by_session(sid).kill()

    chunks = read_with_a_kill(fab, kill)
    assert killed, "the stream ended before the kill"
    assert_one_whole_answer(chunks, prompt_tokens)
    assert fab.resumes("resumed") == 1 and fab.resumes("failed") == 0


def test_the_wire_format_of_a_resumed_stream_is_one_terminated_sse_response(
    mesh: LocalMesh,
) -> None:
    fab = start_mesh(mesh, 2)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": TOKENS, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", fab.ingress.http_url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():  # httpx raises if the chunked body is not terminated
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == KILL_AFTER:
                fab.by_session(r.headers["x-fabric-node"]).kill()
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    docs = [json.loads(e) for e in events[:-1]]
    assert not any("error" in d for d in docs)
    text = "".join(d["choices"][0]["delta"].get("content") or "" for d in docs)
    assert len(text.split()) == TOKENS


def test_a_stream_whose_engine_dies_under_its_own_ingress_continues_elsewhere(
    mesh: LocalMesh,
) -> None:
    """One hop: the client talks to the serving node itself, and its engine (not its agent)
    dies mid-answer.

    Both nodes serve before the stream starts, so nothing but the answer's own pace (the
    engine's ``--slowdown``) stands between the tenth chunk and the kill: starting the second
    node mid-answer, as this test once did, could outlast the answer on a busy host. The answer
    stays on the entry node because its session is sticky there: its first turn went to the
    entry node while that was the only one."""
    entry_node = mesh.start("s0", args=[*SLOW[:-1], "--slowdown 40"])
    assert wait_until(lambda: models_listed(entry_node) == 1, 30)
    fab = Mesh(mesh, entry_node, [entry_node])
    session = {"X-Session-Id": "one-hop"}
    prompt_tokens = unbroken_prompt_tokens(fab, session)  # pins the session to s0
    fab.servers.append(mesh.start("s1", args=SLOW))
    assert wait_until(lambda: models_listed(entry_node) == 2, 30), "s1 does not serve"
    killed: list[str] = []

    def kill_engine(sid: str) -> None:
        assert sid == entry_node.session_id, "the sticky session went to another node"
        local = 'fabric_ingress_inflight{side="local"}'
        assert metrics(entry_node.http_url).get(local) == 1, "the answer ended before the kill"
        engine = engine_process(entry_node)
        assert engine is not None
        os.kill(engine.pid, signal.SIGKILL)
        killed.append(sid)

    chunks = read_with_a_kill(fab, kill_engine, entry_node, session)
    assert killed, "the stream ended before the kill"
    assert_one_whole_answer(chunks, prompt_tokens)
    assert fab.resumes("resumed", entry_node) == 1


def test_without_another_node_the_stream_ends_with_the_error_event(mesh: LocalMesh) -> None:
    fab = start_mesh(mesh, 1)
    with pytest.raises(openai.APIError) as raised:
        read_with_a_kill(fab, lambda sid: fab.by_session(sid).kill())
    assert isinstance(raised.value.body, dict) and raised.value.body["code"] == "upstream_broken"
    assert wait_until(lambda: fab.resumes("failed") == 1, 5)


def test_a_client_can_turn_resuming_off(mesh: LocalMesh) -> None:
    fab = start_mesh(mesh, 2)
    with pytest.raises(openai.APIError) as raised:
        read_with_a_kill(
            fab, lambda sid: fab.by_session(sid).kill(), headers={"X-Fabric-Resume": "off"}
        )
    assert isinstance(raised.value.body, dict) and raised.value.body["code"] == "upstream_broken"
    assert fab.resumes("not_resumable") == 1 and fab.resumes("resumed") == 0
