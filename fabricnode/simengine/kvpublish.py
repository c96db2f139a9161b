"""The simulated engine's KV-cache events, published as vLLM publishes them (issue 42).

``--kv-events-config`` takes vLLM's JSON (``vllm/config/kv_events.py``):
``enable_kv_cache_events``, ``publisher`` (``"zmq"``, or ``"null"``: none; default ``"zmq"``
when enabled), ``endpoint`` (default ``tcp://*:5557``), ``topic`` (default ``""``), ``hwm``;
``buffer_steps`` and ``max_queue_size`` are accepted and change nothing here. A replay socket
(``replay_endpoint``) is refused by name: the simulated engine keeps no replay buffer yet. As
vLLM's ``ZmqEventPublisher`` does, an endpoint with a ``*`` (or ``::``, ``ipc://``,
``inproc://``) is bound and any other connected to, so a subscriber on 127.0.0.1 binds and the
engine connects to it. Every batch the scheduler's prefix cache recorded in a step goes out
as one message ``(topic, seq, payload)``, ``seq`` counting from 0, the payload
``kvevents.wire.encode``'s: the tagged maps of vLLM 0.32, or with ``--kv-events-encoding
positional`` the positional arrays of the vLLM before mid-2026. A send never blocks the
engine: past the high-water mark the PUB socket drops, as vLLM's does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import zmq

from fabricnode.errors import ConfigError
from fabricnode.kvevents.wire import Batch, encode

DEFAULT_ENDPOINT = "tcp://*:5557"
KNOWN_KEYS = frozenset(
    {
        "enable_kv_cache_events",
        "publisher",
        "endpoint",
        "replay_endpoint",
        "buffer_steps",
        "hwm",
        "max_queue_size",
        "topic",
    }
)


@dataclass(frozen=True)
class KvEventsConfig:
    endpoint: str = DEFAULT_ENDPOINT
    topic: str = ""
    hwm: int = 100_000
    positional: bool = False  # the encoding of vLLM before mid-2026 (``--kv-events-encoding``)


def parse_config(text: str, encoding: str = "tagged") -> KvEventsConfig | None:
    """``--kv-events-config``'s JSON: the publisher's settings, or None when events are off
    (not enabled, or ``publisher`` ``"null"``). ``ConfigError`` names what is wrong."""
    try:
        doc: Any = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--kv-events-config: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError("--kv-events-config: expected a JSON object")
    unknown = sorted(set(doc) - KNOWN_KEYS)
    if unknown:
        raise ConfigError(f"--kv-events-config: unknown keys {', '.join(unknown)}")
    if encoding not in ("tagged", "positional"):
        raise ConfigError(f"--kv-events-encoding: {encoding!r} is not tagged or positional")
    enabled = doc.get("enable_kv_cache_events", False)
    if not isinstance(enabled, bool):
        raise ConfigError("--kv-events-config: enable_kv_cache_events is not true or false")
    publisher = doc.get("publisher") or ("zmq" if enabled else "null")
    if publisher not in ("zmq", "null"):
        raise ConfigError(f"--kv-events-config: publisher {publisher!r} is not zmq or null")
    if not enabled or publisher == "null":
        return None
    if doc.get("replay_endpoint"):
        raise ConfigError("--kv-events-config: replay_endpoint: the simulated engine keeps none")
    endpoint, topic, hwm = (
        doc.get("endpoint", DEFAULT_ENDPOINT),
        doc.get("topic", ""),
        doc.get("hwm", 100_000),
    )
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ConfigError(f"--kv-events-config: endpoint {endpoint!r} is not a ZMQ endpoint")
    if not isinstance(topic, str) or len(topic.encode()) > 256:
        raise ConfigError("--kv-events-config: topic is not a string of at most 256 bytes")
    if isinstance(hwm, bool) or not isinstance(hwm, int) or hwm < 0:
        raise ConfigError("--kv-events-config: hwm is not a count")
    return KvEventsConfig(endpoint, topic, hwm, encoding == "positional")


def binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds ``endpoint`` (else it connects to it)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvPublisher:
    """One ZMQ PUB socket and the sequence of the batches sent on it."""

    def __init__(self, config: KvEventsConfig) -> None:
        self.config = config
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.set_hwm(config.hwm)
        try:
            if binds(config.endpoint):
                self._sock.bind(config.endpoint)
            else:
                self._sock.connect(config.endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(f"--kv-events-config: endpoint {config.endpoint}: {exc}") from None
        self._topic = config.topic.encode()
        self.seq = 0
        self.dropped = 0

    def publish(self, batch: Batch) -> None:
        frames = encode(self._topic, self.seq, batch, positional=self.config.positional)
        self.seq += 1
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
