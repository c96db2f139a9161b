"""The agent reads its engine's KV-cache events (issue 42): a ZMQ SUB socket on localhost, the
messages decoded, sequenced and applied to the engine's block index (``fabricnode.kvevents``).

Where: for vLLM and the simulated engine that the agent starts, the agent binds a SUB socket on
127.0.0.1 at a free port before the engine starts and adds ``--kv-events-config`` with that
endpoint to the engine's command (``command.with_kv_events``): the engine's publisher connects
to it, nothing listens beyond localhost. A command that gives its own ``--kv-events-config``
keeps it, and the agent reads where it says (``command.kv_subscription``: it connects to an
engine that binds ``tcp://*:PORT``, binds a ``tcp://127.0.0.1:PORT`` the engine connects to;
anything else, or events off, and there is no reader). ``fabric start --no-kv-events`` adds
nothing.

How: no thread. The socket's file descriptor wakes the task (``trio.lowlevel.wait_readable``;
ZMQ's descriptor is edge-triggered, so every wake drains what ``zmq.EVENTS`` says is there,
at most ``BURST`` messages before a checkpoint). Each message is decoded strictly
(``kvevents.wire``; a malformed one is dropped and counted), checked for our topic, and
sequenced (``kvevents.stream``): applied in order; a repeat dropped; a gap (the PUB dropped
past its high-water mark, or we came late) or a new engine process empties the index before
the message is applied, since what was lost may have removed blocks. The agent also empties
it when it restarts the engine. Bounds: ZMQ drops a message over ``MAX_MESSAGE_BYTES`` before
we see it and holds at most ``RCVHWM`` unread ones; the index holds at most its
``max_blocks``.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import trio
import zmq

from fabricnode.engine.command import (
    CONNECT_HOST,
    EngineCommand,
    KvSubscription,
    given_kv_events,
    kv_events_supported,
    kv_subscription,
    with_kv_events,
)
from fabricnode.errors import DecodeError
from fabricnode.kvevents.index import BlockIndex
from fabricnode.kvevents.stream import DROP, GAP, RESTARTED, EventStream
from fabricnode.kvevents.wire import MAX_PAYLOAD_BYTES, decode

log = logging.getLogger(__name__)

BURST = 64  # messages applied between checkpoints
RCVHWM = 1000  # unread messages ZMQ keeps for us; past it, the engine's PUB drops
MAX_MESSAGE_BYTES = MAX_PAYLOAD_BYTES + 4096
OUTCOMES = ("applied", "repeated", "gap", "restarted", "malformed", "other_topic")


@dataclass(frozen=True)
class KvEventStatistics:
    endpoint: str
    messages: dict[str, int]  # by outcome (``OUTCOMES``)
    blocks: int  # held now
    stored: int
    removed: int
    refused: int  # blocks past the index's bound
    clears: int


class KvEventReader:
    """One engine's KV-cache events (module docstring)."""

    def __init__(self, subscription: KvSubscription, max_blocks: int | None = None) -> None:
        self.subscription = subscription
        self.index = BlockIndex() if max_blocks is None else BlockIndex(max_blocks)
        self.stream = EventStream()
        self.messages: Counter[str] = Counter()
        self._topic = subscription.topic.encode()
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        try:
            if subscription.bind:
                sock.bind(subscription.endpoint)
                # "tcp://127.0.0.1:*" asks for a free port: the one bound is what the engine gets
                bound = sock.getsockopt(zmq.LAST_ENDPOINT)
                self.endpoint = bound.decode() if isinstance(bound, bytes) else str(bound)
            else:
                sock.connect(subscription.endpoint)
                self.endpoint = subscription.endpoint
        except zmq.ZMQError:
            sock.close()
            self._ctx.term()
            raise
        self._sock = sock

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()

    def engine_restarted(self) -> None:
        """A new engine process: what the old one cached is gone."""
        self.index.clear()

    async def run(self) -> None:
        sock = self._sock
        fd = int(sock.getsockopt(zmq.FD))
        try:
            while True:
                drained = 0
                while drained < BURST and int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.on_message(frames)
                    drained += 1
                if drained >= BURST:
                    await trio.lowlevel.checkpoint()
                    continue
                await trio.lowlevel.wait_readable(fd)
        finally:
            self.close()

    def on_message(self, frames: list[bytes]) -> None:
        """Decode, sequence and apply one message (module docstring); never raises on what
        the engine sent."""
        try:
            message = decode(frames)
        except DecodeError as exc:
            self._count("malformed")
            if self.messages["malformed"] == 1:
                log.warning("kv events: a malformed message from the engine dropped: %s", exc)
            return
        if message.topic != self._topic:
            self._count("other_topic")
            return
        verdict = self.stream.accept(message.seq)
        if verdict.action == DROP:
            self._count("repeated")
            return
        if verdict.action == GAP:
            self.index.clear()  # lost batches may have removed blocks: start over from here
            self.stream.resync(message.seq)
            self._count("gap")
        elif verdict.action == RESTARTED:
            self.index.clear()
            self._count("restarted")
        else:
            self._count("applied")
        self.index.apply(message.batch)

    def _count(self, outcome: str) -> None:
        self.messages[outcome] += 1

    def statistics(self) -> KvEventStatistics:
        applied = self.index.applied
        return KvEventStatistics(
            self.endpoint,
            {o: self.messages.get(o, 0) for o in OUTCOMES},
            len(self.index),
            applied.stored,
            applied.removed,
            applied.refused,
            applied.cleared,
        )


def reader_for(command: EngineCommand) -> tuple[KvEventReader | None, EngineCommand]:
    """The reader of ``command``'s engine's KV-cache events and the command to run (with
    ``--kv-events-config`` added when it gives none); (None, command) for an engine whose
    events we do not read, or one whose option turns them off or points elsewhere."""
    if not kv_events_supported(command):
        return None, command
    given = given_kv_events(command)
    if given is None:
        try:
            reader = KvEventReader(KvSubscription(f"tcp://{CONNECT_HOST}:*", True, "kv-events"))
        except zmq.ZMQError as exc:
            log.warning("kv events: no socket for the engine's events: %s", exc)
            return None, command
        return reader, with_kv_events(command, reader.endpoint)
    subscription = kv_subscription(given)
    if subscription is None:
        return None, command
    try:
        return KvEventReader(subscription), command
    except zmq.ZMQError as exc:
        log.warning("kv events: cannot read %s: %s", subscription.endpoint, exc)
        return None, command
