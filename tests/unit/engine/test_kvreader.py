"""The agent's reader of its engine's KV-cache events (``fabricnode.engine.kvreader``) and the
command it runs the engine with (``command.with_kv_events``, ``kv_subscription``): a real ZMQ
socket pair on localhost, the simulated engine's encoder as the publisher."""

from __future__ import annotations

import json

import trio
import zmq

from fabricnode.engine.command import (
    KvSubscription,
    inspect_engine_cmd,
    kv_subscription,
    with_kv_events,
)
from fabricnode.engine.kvreader import KvEventReader, reader_for
from fabricnode.kvevents.wire import Batch, Cleared, Stored, encode

TOKENS = tuple(range(32))


def stored(*hashes: bytes) -> Batch:
    return Batch(1.0, (Stored(hashes, None, TOKENS[: 16 * len(hashes)], 16),))


def test_an_engine_the_agent_starts_gets_events_on_a_localhost_port_it_connects_to() -> None:
    vllm = inspect_engine_cmd(["vllm", "serve", "m", "--port", "8001"])
    reader, command = reader_for(vllm)
    assert reader is not None
    try:
        assert reader.endpoint.startswith("tcp://127.0.0.1:")
        flag = command.argv.index("--kv-events-config")
        doc = json.loads(command.argv[flag + 1])
        assert doc == {"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": reader.endpoint, "topic": "kv-events"}  # fmt: skip
        assert with_kv_events(command, "tcp://127.0.0.1:1") == command  # given: kept
    finally:
        reader.close()
    other = inspect_engine_cmd(["my-server", "--port", "9000"])
    assert reader_for(other) == (None, other)  # an engine whose events we do not read


def test_a_command_that_gives_its_own_config_is_read_where_it_says() -> None:
    def config(**doc: object) -> str:
        return json.dumps({"enable_kv_cache_events": True, **doc})

    binds = kv_subscription(config(endpoint="tcp://*:5557", topic="t"))
    assert binds is not None and (binds.endpoint, binds.bind, binds.topic) == (
        "tcp://127.0.0.1:5557", False, "t")  # fmt: skip
    connects = kv_subscription(config(endpoint="tcp://127.0.0.1:6000"))
    assert connects is not None and connects.bind
    assert kv_subscription(config(endpoint="tcp://10.0.0.9:6000")) is None  # another host
    assert kv_subscription(json.dumps({"enable_kv_cache_events": False})) is None
    assert kv_subscription(config(publisher="null")) is None
    assert kv_subscription("{") is None
    off = inspect_engine_cmd(["vllm", "serve", "m", "--kv-events-config",
                              json.dumps({"enable_kv_cache_events": False})])  # fmt: skip
    assert reader_for(off) == (None, off)


async def test_the_reader_applies_in_order_drops_repeats_and_empties_on_gaps_and_restarts() -> None:
    reader = KvEventReader(KvSubscription("tcp://127.0.0.1:*", True, "kv-events"))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(reader.endpoint)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)

            async def send(frames: list[bytes], settle: int = 0) -> None:
                pub.send_multipart(frames)
                with trio.fail_after(5):
                    while sum(reader.messages.values()) <= settle:
                        await trio.sleep(0.01)

            # a PUB drops what it sends before the subscription reached it: send until one lands
            with trio.fail_after(5):
                while not reader.messages:
                    pub.send_multipart(encode(b"kv-events", 0, stored(b"a")))
                    await trio.sleep(0.05)
            seen = sum(reader.messages.values())
            assert reader.index.holds(b"a")
            await send(encode(b"kv-events", 1, stored(b"b")), seen)
            await send(encode(b"kv-events", 1, stored(b"c")), seen + 1)  # a repeat
            assert reader.messages["repeated"] == 1 and not reader.index.holds(b"c")
            await send([b"kv-events", b"\x00", b"junk"], seen + 2)
            assert reader.messages["malformed"] == 1
            await send(encode(b"kv-events-b", 2, stored(b"d")), seen + 3)  # our prefix only
            assert reader.messages["other_topic"] == 1
            await send(encode(b"kv-events", 5, stored(b"e")), seen + 4)  # 2..4 lost
            assert reader.messages["gap"] == 1
            assert reader.index.holds(b"e") and not reader.index.holds(b"a")
            await send(encode(b"kv-events", 0, stored(b"f")), seen + 5)  # a new engine
            assert reader.messages["restarted"] == 1 and len(reader.index) == 1
            await send(encode(b"kv-events", 1, Batch(2.0, (Cleared(),))), seen + 6)
            assert len(reader.index) == 0
            stats = reader.statistics()
            assert stats.messages["applied"] >= 3 and stats.clears >= 3
            nursery.cancel_scope.cancel()
    finally:
        pub.close(0)
        ctx.term()
