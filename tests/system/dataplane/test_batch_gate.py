"""The batch gate of an in-process ``Ingress`` over real sockets, in front of fake nodes that
record what reaches them and answer when the test lets them (``FakeNode``): a node without a
load report takes one batch request at a time, so the test decides exactly when there is room.

What is checked: batch requests wait while no node has room and go on, in order, when room
appears; an interactive request passes while they wait; the gate refuses past its size and
past the longest wait (503 with Retry-After); a client that hangs up leaves the gate; the
batch owner header (good token, wrong token, unknown key, no rate limit); the tier headers
never reach a node; the ``priority`` field only reaches nodes whose engine schedules by it.

The gate's decisions themselves (``dataplane.gate.BatchGate``) are unit-tested without sockets
under a fake clock (``tests/unit/dataplane/test_gate.py``); what stays here is what only real
sockets show: the shell waking on events and deadlines, the answers on the wire, hang-ups, and
taken-back attempts closing their connections.
"""

from __future__ import annotations

import json
import random
import re
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import pytest
import trio

from fabricnode.dataplane.apikeys import ApiKeyStore
from fabricnode.dataplane.ingress import Ingress
from fabricnode.dataplane.ingress_config import IngressConfig
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import Identity
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.registry import Addresses, ModelInfo, State
from fabricnode.mesh.schema import PRIORITY_SCHEDULING_LABEL
from fabricnode.mesh.wire import Alive, EntryMsg, Load
from fabricnode.testing.simnet import make_body

pytestmark = pytest.mark.slow

TOKEN = "5" * 32
REFUSED = json.dumps(
    {"error": {"message": "forward refused: forward header does not verify", "type": "x",
               "code": "forward_refused"}}
).encode()  # fmt: skip
ANSWER = json.dumps(
    {"id": "x", "object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 1}}
).encode()


@dataclass
class FakeNode:
    """A node's HTTP port: records each request (head, body) and answers it with a small JSON
    body, at once unless its body asks to be held (``"hold"`` in it): then when ``release``
    is called."""

    received: list[tuple[bytes, bytes]] = field(default_factory=list)
    held: int = 0
    failing: bool = False  # answer 503 (the ingress fails over)
    # answer 403 forward_refused naming this session (an agent refusing a forward: another
    # one at the node's address names another session than the node's)
    refusing_as: str = ""
    _release: trio.Event = field(default_factory=trio.Event)

    def release(self) -> None:
        self._release.set()
        self._release = trio.Event()

    async def serve(self, listener: trio.SocketListener) -> None:
        async def handle(stream: trio.SocketStream) -> None:
            async with stream:
                buf = b""
                while True:
                    data = await stream.receive_some()
                    if not data:
                        return
                    buf += data
                    while True:
                        head, sep, rest = buf.partition(b"\r\n\r\n")
                        if not sep:
                            break
                        found = re.search(rb"content-length: (\d+)", head.lower())
                        length = int(found.group(1)) if found else 0
                        if len(rest) < length:
                            break
                        body, buf = rest[:length], rest[length:]
                        self.received.append((head.lower(), body))
                        if b'"hold"' in body:
                            self.held += 1
                            await self._release.wait()
                            self.held -= 1
                        if self.failing:
                            await stream.send_all(
                                b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
                            )
                            continue
                        if self.refusing_as:
                            await stream.send_all(
                                b"HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\n"
                                b"x-fabric-node: %s\r\ncontent-length: %d\r\n\r\n%s"
                                % (self.refusing_as.encode(), len(REFUSED), REFUSED)
                            )
                            continue
                        await stream.send_all(
                            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                            b"content-length: %d\r\n\r\n" % len(ANSWER) + ANSWER
                        )

        await trio.serve_listeners(handle, [listener])


@dataclass
class Gate:
    ingress: Ingress
    url: str
    nodes: list[FakeNode]
    sids: list[str]
    keys: dict[str, str]
    core: MeshCore

    def report(self, node: int, *, kv_usage: float, waiting: int = 0, running: int = 1) -> None:
        """A fresh load report of node ``node`` (``waiting`` queued, ``running``; ``kv_usage``)."""
        now = time.time()
        self.seq += 1
        load = Load(self.sids[node], self.seq, waiting, running, kv_usage, 0, now)
        self.core.ingest([load], now)
        self.ingress.mesh_changed()  # as the agent's gossip service tells it

    seq: int = 0

    async def until(self, what: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Wait until ``what`` holds (checked every 10 ms), failing past ``timeout_s``."""
        with trio.fail_after(timeout_s):
            while not what():
                await trio.sleep(0.01)

    def waiting(self) -> int:
        return self.ingress.statistics().batch_waiting

    def preempted(self) -> int:
        text = self.ingress.render_metrics().decode()
        found = re.search(r"^fabric_ingress_batch_preempted_total (\S+)$", text, re.M)
        return int(float(found.group(1))) if found else 0


@asynccontextmanager
async def gate(
    tmp_path: Path,
    *,
    config: IngressConfig | None = None,
    labels: tuple[tuple[str, str], ...] = (),
    nodes: int = 1,
    keys: bool = False,
    node_labels: list[tuple[tuple[str, str], ...]] | None = None,
) -> AsyncIterator[Gate]:
    """An ingress in front of ``nodes`` fake nodes serving m1 (each with ``labels``, or its
    own of ``node_labels``), none with a load report: each takes one batch request at a time."""
    now = time.time()
    me = Identity.from_seed(b"batch-gate-ingress")
    core = MeshCore(me, Keyring.with_key(b"k" * 32), make_body(me, "127.0.0.1:1", now), now)
    store: ApiKeyStore | None = None
    tokens: dict[str, str] = {}
    if keys:
        store = ApiKeyStore.load(tmp_path / "keys.json")
        for name in ("alice", "bob"):
            token, key = store.new_key(name, rate_per_s=0.01, burst=1)
            tokens[name], tokens[name + "-id"] = token, key.key_id
    async with trio.open_nursery() as nursery:
        fakes, sids = [], []
        records: list[EntryMsg | Alive] = []
        for i in range(nodes):
            fake = FakeNode()
            (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
            nursery.start_soon(fake.serve, listener)
            node = Identity.from_seed(b"batch-gate-node-%d" % i)
            gossip = f"127.0.0.1:{41000 + i}"
            body = replace(
                make_body(node, gossip, now),
                state=State.SERVING,
                models=(ModelInfo("m1", 4096),),
                labels=node_labels[i] if node_labels is not None else labels,
                addresses=Addresses(
                    http=f"http://127.0.0.1:{listener.socket.getsockname()[1]}", gossip=gossip
                ),
            )
            records += [EntryMsg(body.sign(node)), Alive.make(node, 1, gossip)]
            fakes.append(fake)
            sids.append(node.session_id)
        core.ingest(records, now)
        ingress = Ingress(
            core,
            config=config or IngressConfig(),
            wall_clock=time.time,
            rng=random.Random(7),
            api_keys=store,
            batch_token=TOKEN,
        )
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await nursery.start(ingress.serve, sock, trio.Event(), 0.1)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"
        yield Gate(ingress, url, fakes, sids, tokens, core)
        for fake in fakes:
            fake.release()
        nursery.cancel_scope.cancel()


def chat(text: str = "hi", **extra: object) -> dict[str, object]:
    return {"model": "m1", "messages": [{"role": "user", "content": text}], **extra}


BATCH = {"x-fabric-priority": "batch"}


async def test_batch_requests_wait_for_room_and_interactive_ones_pass_them(tmp_path: Path) -> None:
    async with gate(tmp_path) as g, httpx.AsyncClient(timeout=20) as client:
        node = g.nodes[0]
        answers: dict[str, httpx.Response] = {}

        async def send(name: str, headers: dict[str, str]) -> None:
            answers[name] = await client.post(g.url, json=chat(name, hold=True), headers=headers)

        async with trio.open_nursery() as senders:
            senders.start_soon(send, "first", BATCH)
            await g.until(lambda: node.held == 1)  # the node's one batch slot is taken
            senders.start_soon(send, "second", BATCH)
            await g.until(lambda: g.waiting() == 1)
            senders.start_soon(send, "third", BATCH)
            await g.until(lambda: g.waiting() == 2)
            # An interactive request is not held by the gate: it reaches the node now.
            senders.start_soon(send, "interactive", {})
            await g.until(lambda: node.held == 2)
            assert g.waiting() == 2
            # Room: the first batch request ends (the interactive one with it), the second
            # goes; it ends, the third goes; it ends.
            node.release()
            await g.until(lambda: len(answers) == 2 and node.held == 1 and g.waiting() == 1)
            node.release()
            await g.until(lambda: len(answers) == 3 and node.held == 1 and g.waiting() == 0)
            node.release()
        assert {name: r.status_code for name, r in answers.items()} == dict.fromkeys(
            ("first", "second", "third", "interactive"), 200
        )
        texts = [json.loads(body)["messages"][0]["content"] for _, body in node.received]
        assert texts == ["first", "interactive", "second", "third"]
        assert g.waiting() == 0 and g.ingress.batch_inflight == {}


async def test_the_gate_refuses_past_its_size_and_past_the_longest_wait(tmp_path: Path) -> None:
    config = IngressConfig(max_batch_waiting=1, batch_max_wait_s=0.5)
    async with gate(tmp_path, config=config) as g, httpx.AsyncClient(timeout=20) as client:
        answers: dict[str, httpx.Response] = {}

        async def send(name: str) -> None:
            answers[name] = await client.post(g.url, json=chat(name, hold=True), headers=BATCH)

        async with trio.open_nursery() as senders:
            senders.start_soon(send, "holder")
            await g.until(lambda: g.nodes[0].held == 1)
            senders.start_soon(send, "waiter")
            await g.until(lambda: g.waiting() == 1)
            full = await client.post(g.url, json=chat("one too many"), headers=BATCH)
            await g.until(lambda: "waiter" in answers)  # past batch_max_wait_s
            g.nodes[0].release()
        assert full.status_code == 503 and full.headers["retry-after"] == "5"
        assert full.json()["error"]["code"] == "batch_queue_full"
        late = answers["waiter"]
        assert late.status_code == 503 and late.headers["retry-after"] == "5"
        assert late.json()["error"]["code"] == "batch_wait_timeout"
        assert answers["holder"].status_code == 200
        assert g.waiting() == 0


async def test_a_client_that_hangs_up_leaves_the_gate(tmp_path: Path) -> None:
    async with gate(tmp_path) as g, httpx.AsyncClient(timeout=20) as client:
        async with trio.open_nursery() as senders:
            senders.start_soon(
                lambda: client.post(g.url, json=chat("holder", hold=True), headers=BATCH)
            )
            await g.until(lambda: g.nodes[0].held == 1)
            host, port = g.url.removeprefix("http://").split("/")[0].split(":")
            body = json.dumps(chat("leaves")).encode()
            stream = await trio.open_tcp_stream(host, int(port))
            await stream.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-fabric-priority: batch\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body
            )
            await g.until(lambda: g.waiting() == 1)
            await stream.aclose()
            await g.until(lambda: g.waiting() == 0)
            g.nodes[0].release()
        assert [json.loads(b)["messages"][0]["content"] for _, b in g.nodes[0].received] == [
            "holder"
        ]


async def test_the_owner_header_makes_a_batch_request_for_a_key_without_its_rate_limit(
    tmp_path: Path,
) -> None:
    async with gate(tmp_path, keys=True) as g, httpx.AsyncClient(timeout=20) as client:
        owner = {"x-fabric-batch-owner": f"{TOKEN} {g.keys['alice-id']}"}
        # alice's key allows one request per 100 s; her batch worker's are not rate limited
        for i in range(3):
            r = await client.post(g.url, json=chat(f"owned {i}"), headers=owner)
            assert r.status_code == 200, r.text
        bearer = {"authorization": f"Bearer {g.keys['alice']}"}
        assert (await client.post(g.url, json=chat(), headers=bearer)).status_code == 200
        assert (await client.post(g.url, json=chat(), headers=bearer)).status_code == 429
        refused = {
            "wrong token": {"x-fabric-batch-owner": f"{'6' * 32} {g.keys['alice-id']}"},
            "unknown key": {"x-fabric-batch-owner": f"{TOKEN} 0badc0de"},
            "no tenant": {"x-fabric-batch-owner": TOKEN},
        }
        for why, headers in refused.items():
            r = await client.post(g.url, json=chat(), headers=headers)
            assert r.status_code == 401, (why, r.text)
        seen = g.ingress.render_metrics().decode()
        assert 'fabric_ingress_batch_admitted_total{key="alice"} 3.0' in seen
        assert 'fabric_ingress_tier_requests_total{tier="batch"} 3.0' in seen
        # neither tier header reaches the node
        for head, _ in g.nodes[0].received:
            assert b"x-fabric-batch-owner" not in head and b"x-fabric-priority" not in head


@pytest.mark.parametrize("priority_node", [False, True])
async def test_the_priority_field_goes_only_to_nodes_that_schedule_by_it(
    tmp_path: Path, priority_node: bool
) -> None:
    labels = ((PRIORITY_SCHEDULING_LABEL, "1"),) if priority_node else ()
    config = IngressConfig(batch_priority=7)
    async with gate(tmp_path, config=config, labels=labels) as g, httpx.AsyncClient() as client:
        sent = json.dumps(chat("as sent", temperature=0.5)).encode()
        for headers in (BATCH, {"x-fabric-priority": "interactive"}, {}):
            r = await client.post(
                g.url, content=sent, headers={**headers, "content-type": "application/json"}
            )
            assert r.status_code == 200, r.text
        # a completion and a Responses request too (their kinds carry the field in vLLM)
        for path, body in (
            ("/v1/completions", {"model": "m1", "prompt": "x"}),
            ("/v1/responses", {"model": "m1", "input": "x"}),
        ):
            r = await client.post(
                g.url.replace("/v1/chat/completions", path), json=body, headers=BATCH
            )
            assert r.status_code == 200, r.text
    bodies = [body for _, body in g.nodes[0].received]
    batch, interactive, default, completion, responses = (json.loads(b) for b in bodies)
    assert bodies[1] == bodies[2] == sent  # interactive: byte for byte
    if priority_node:
        assert batch == {**json.loads(sent), "priority": 7}
        assert completion["priority"] == responses["priority"] == 7
    else:
        assert bodies[0] == sent  # no field for an engine on first come, first served
        assert "priority" not in completion and "priority" not in responses
    assert "priority" not in interactive and "priority" not in default


async def test_a_batch_request_failing_over_to_a_node_without_priority_goes_as_it_came(
    tmp_path: Path,
) -> None:
    """Node 0 schedules by priority but fails; node 1 does not and has no room at first. The
    batch request goes to node 0 with the field, fails over, waits in the gate for room on
    node 1, and reaches it with the body as the client sent it."""
    labels = [((PRIORITY_SCHEDULING_LABEL, "1"),), ()]
    async with gate(tmp_path, nodes=2, node_labels=labels) as g:
        g.nodes[0].failing = True
        g.report(0, kv_usage=0.1)
        g.report(1, kv_usage=0.9)  # above the batch KV threshold: no room
        sent = json.dumps(chat("fails over")).encode()
        async with httpx.AsyncClient(timeout=20) as client, trio.open_nursery() as senders:
            answer: list[httpx.Response] = []

            async def send() -> None:
                headers = {**BATCH, "content-type": "application/json"}
                answer.append(await client.post(g.url, content=sent, headers=headers))

            senders.start_soon(send)
            await g.until(lambda: len(g.nodes[0].received) == 1 and g.waiting() == 1)
            g.report(1, kv_usage=0.2)  # room: the gate's tick lets it go
        assert answer[0].status_code == 200
        assert json.loads(g.nodes[0].received[0][1]) == {**json.loads(sent), "priority": 1}
        assert [body for _, body in g.nodes[1].received] == [sent]


@pytest.mark.parametrize("by_priority", [True, False])
async def test_an_interactive_request_does_not_count_batch_work_its_engine_serves_after_it(
    tmp_path: Path, by_priority: bool
) -> None:
    """Node 0 runs six of our batch requests, node 1 three requests of its own. Where the
    engines schedule by priority, an interactive request goes ahead of the batch ones, so node 0
    is the less loaded for it; where they serve first come first served, it is node 1."""
    labels = ((PRIORITY_SCHEDULING_LABEL, "1"),) if by_priority else ()
    async with gate(tmp_path, nodes=2, labels=labels) as g, httpx.AsyncClient(timeout=20) as client:
        g.report(0, kv_usage=0.1)
        g.report(1, kv_usage=0.9)  # above the batch KV threshold: the batch goes to node 0
        async with trio.open_nursery() as senders:
            for i in range(6):
                senders.start_soon(
                    lambda i=i: client.post(g.url, json=chat(f"b{i}", hold=True), headers=BATCH)
                )
            await g.until(lambda: g.nodes[0].held == 6)
            g.report(0, kv_usage=0.3, running=6)
            g.report(1, kv_usage=0.9, running=3)
            r = await client.post(g.url, json=chat("interactive"))
            assert r.status_code == 200
            g.nodes[0].release()
        received = [
            [json.loads(b)["messages"][0]["content"] for _, b in n.received] for n in g.nodes
        ]
        assert ("interactive" in received[0]) is by_priority
        assert ("interactive" in received[1]) is not by_priority
        assert len(received[0]) == 6 + by_priority and g.ingress.batch_hidden == {}


async def test_pacing_sends_a_node_one_batch_request_at_a_time_by_its_prompt(
    tmp_path: Path,
) -> None:
    """With room for many (a fresh report, an empty KV), pacing at 1000 prompt tokens/s holds
    each ~1000-token batch request back about a second after the one before."""
    config = IngressConfig(batch_prefill_tokens_per_s=1000.0)
    async with gate(tmp_path, config=config) as g, httpx.AsyncClient(timeout=20) as client:
        node = g.nodes[0]
        g.report(0, kv_usage=0.0)
        prompt = "word " * 800  # ~4000 bytes of body: the ingress estimates ~1000 tokens

        async def send() -> None:
            r = await client.post(g.url, json=chat(prompt, hold=True), headers=BATCH)
            assert r.status_code == 200

        async with trio.open_nursery() as senders:
            for _ in range(3):
                senders.start_soon(send)
            # room for all three, but one goes now and the others wait their turn
            await g.until(lambda: node.held == 1 and g.waiting() == 2)
            await g.until(lambda: node.held == 2 and g.waiting() == 1, timeout_s=5)
            g.report(0, kv_usage=0.0)  # keep the report fresh
            await g.until(lambda: node.held == 3, timeout_s=5)
            node.release()
        assert g.waiting() == 0


async def test_one_walk_of_the_gate_sends_a_node_one_batch_prompt_not_all_it_has_room_for(
    tmp_path: Path,
) -> None:
    """Three batch requests wait while the node has room for one; then it has room for many.
    The walk of the gate that follows admits one: the prompt it admits is on the node's prefill
    clock at once, so the next waits until the clock says it is computed (~0.4 s for ~4,000
    estimated tokens at the default rate), and the engine never gets them in one step."""
    async with gate(tmp_path) as g, httpx.AsyncClient(timeout=20) as client:
        node = g.nodes[0]
        prompt = "word " * 3200  # ~16,000 bytes of body: ~4,000 estimated tokens

        async def send() -> None:
            r = await client.post(g.url, json=chat(prompt, hold=True), headers=BATCH)
            assert r.status_code == 200

        async with trio.open_nursery() as senders:
            senders.start_soon(send)
            await g.until(lambda: node.held == 1)  # no load report: room for one
            for _ in range(3):
                senders.start_soon(send)
            await g.until(lambda: g.waiting() == 3)
            g.report(0, kv_usage=0.0)  # a fresh report: room for many
            node.release()
            await g.until(lambda: g.waiting() < 3)
            assert g.waiting() == 2  # one went; the others wait for the clock
            for left in (1, 0):
                g.report(0, kv_usage=0.0)
                await g.until(lambda left=left: g.waiting() == left, timeout_s=5)
            await g.until(lambda: node.held == 3)
            node.release()
        assert g.waiting() == 0


async def test_batch_requests_yield_their_node_when_its_engine_queues_with_a_full_cache(
    tmp_path: Path,
) -> None:
    """A fresh report showing the engine queueing with its KV cache at the preemption threshold
    takes back the newest batch request there that has no answer yet (one per queued request,
    once per report): its connection closes and it waits in the gate again, then goes when
    there is room. Interactive requests are never taken back; every client gets one answer."""
    config = IngressConfig(batch_max_inflight_per_node=4)
    async with gate(tmp_path, config=config) as g, httpx.AsyncClient(timeout=20) as client:
        node = g.nodes[0]
        g.report(0, kv_usage=0.1)
        answers: dict[str, httpx.Response] = {}

        async def send(name: str, headers: dict[str, str]) -> None:
            answers[name] = await client.post(g.url, json=chat(name, hold=True), headers=headers)

        async with trio.open_nursery() as senders:
            for n, name in enumerate(("first", "second", "third")):
                senders.start_soon(send, name, BATCH)
                await g.until(lambda n=n: node.held == n + 1)  # type: ignore[misc]
            senders.start_soon(send, "interactive", {})
            await g.until(lambda: node.held == 4)
            assert g.preempted() == 0
            # The engine queues one request with its cache 95% full: the newest batch request
            # is taken back, and waits (the report shows a queue: no room).
            g.report(0, kv_usage=0.95, waiting=1)
            await g.until(lambda: g.preempted() == 1 and g.waiting() == 1)
            await trio.sleep(0.35)  # a while on the same report: no second one
            assert g.preempted() == 1 and g.waiting() == 1
            assert g.ingress.batch_inflight == {g.sids[0]: 2}
            # Room again: it goes back to the node.
            g.report(0, kv_usage=0.3)
            await g.until(lambda: len(node.received) == 5)
            for _ in range(5):
                node.release()
                await trio.sleep(0.05)
        assert {name: r.status_code for name, r in answers.items()} == dict.fromkeys(
            ("first", "second", "third", "interactive"), 200
        )
        texts = [json.loads(body)["messages"][0]["content"] for _, body in node.received]
        assert texts == ["first", "second", "third", "interactive", "third"]
        assert g.waiting() == 0 and g.ingress.batch_inflight == {}
        assert g.ingress.batch_preemptible == {}
