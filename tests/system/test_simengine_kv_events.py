"""The simulated engine publishes its prefix cache's KV-cache events as vLLM does (issue 42,
item 4): a real simulated-engine process, ``--kv-events-config`` with an endpoint on 127.0.0.1
that the test's SUB socket binds and the engine connects to (as vLLM's publisher does with an
endpoint without ``*``), every message decoded with ``fabricnode.kvevents.wire``; and usage's
``prompt_tokens_details.cached_tokens`` with ``--enable-prompt-tokens-details``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import zmq

from fabricnode.kvevents.wire import Cleared, Message, Removed, Stored, decode
from tests.support.meshview import free_port
from tests.system.test_simengine_server import MODEL, engine

pytestmark = pytest.mark.slow


@pytest.fixture
def sub() -> Iterator[tuple[zmq.Socket[bytes], int]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    port = free_port()
    sock.bind(f"tcp://127.0.0.1:{port}")
    try:
        yield sock, port
    finally:
        sock.close(0)
        ctx.term()


def messages(sock: zmq.Socket[bytes], until: float = 0.5) -> list[Message]:
    """Every message that arrives until ``until`` seconds pass with none."""
    out: list[Message] = []
    while sock.poll(int(until * 1000)):
        out.append(decode(sock.recv_multipart()))
    return out


def config(port: int) -> str:
    return json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq",
         "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv-events"}
    )  # fmt: skip


@pytest.mark.parametrize("encoding", ["tagged", "positional"])
def test_stored_evicted_and_cleared_blocks_are_published_in_order(
    sub: tuple[zmq.Socket[bytes], int], encoding: str
) -> None:
    sock, port = sub
    flags = ("--kv-events-config", config(port), "--kv-events-encoding", encoding,
             "--kv-tokens", "512", "--enable-prompt-tokens-details")  # fmt: skip
    with engine(*flags) as e, e.client() as client:
        shared = "rules: answer briefly and cite your sources. " * 20
        body = {"model": MODEL, "max_tokens": 2}
        # the publisher connects as the engine starts: a first request until an event comes
        deadline = time.monotonic() + 10
        seen: list[Message] = []
        while not seen and time.monotonic() < deadline:
            client.post("/v1/completions", json={**body, "prompt": f"warm {len(seen)}"})
            seen = messages(sock, 0.3)
        first = client.post("/v1/completions", json={**body, "prompt": shared + "one"}).json()
        again = client.post("/v1/completions", json={**body, "prompt": shared + "two"}).json()
        got = messages(sock)
        stored = [ev for m in got for ev in m.batch.events if isinstance(ev, Stored)]
        assert stored and stored[0].block_size == 16 and stored[0].medium == "GPU"
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 16 * len(stored[0].hashes) - 16  # the shared prefix's blocks hit
        # flood the 512-token cache with other prompts: the shared prefix's blocks are evicted
        for i in range(12):
            client.post("/v1/completions", json={**body, "prompt": f"{i} other words " * 20})
        flooded = messages(sock)
        removed = {h for m in flooded for ev in m.batch.events if isinstance(ev, Removed)
                   for h in ev.hashes}  # fmt: skip
        assert set(stored[0].hashes) <= removed
        assert client.post("/sleep", params={"level": 1}).status_code == 200
        cleared = messages(sock)
        assert any(isinstance(ev, Cleared) for m in cleared for ev in m.batch.events)
    # one publisher's batches, numbered without a gap from the first this subscriber saw
    numbers = [m.seq for m in seen + got + flooded + cleared]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert all(m.topic == b"kv-events" and m.batch.dp_rank == 0 for m in got)


def test_a_bad_kv_events_config_is_refused_with_its_reason() -> None:
    from fabricnode.errors import ConfigError
    from fabricnode.simengine.kvpublish import parse_config

    assert parse_config('{"enable_kv_cache_events": false}') is None
    assert parse_config('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    for bad, said in (
        ("[]", "JSON object"),
        ("{", "not JSON"),
        ('{"enable_kv_cache_events": true, "colour": 1}', "unknown keys colour"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "kafka"),
        ('{"enable_kv_cache_events": true, "endpoint": "localhost"}', "not a ZMQ endpoint"),
        ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"}', "replay"),
    ):
        with pytest.raises(ConfigError, match=said):
            parse_config(bad)
