"""The data plane's limits and timeouts (its own module so ``config`` can import it cheaply)."""

from __future__ import annotations

from dataclasses import dataclass

from fabricnode.dataplane import routing


@dataclass(frozen=True)
class IngressConfig:
    """Every data-plane limit and timeout, with its unit in the name."""

    max_body_bytes: int = 16 * 1024 * 1024
    # Request bodies all connections may hold at once (arriving or being answered): past it a
    # request gets 503 and its connection is closed (``http1.BodyBudget``).
    max_buffered_body_bytes: int = 512 * 1024 * 1024
    max_head_bytes: int = 32 * 1024
    max_headers: int = 100
    max_connections: int = 4096
    # One client address may hold at most this many (a shared login node or gateway needs
    # many; one address must still not be able to take them all), and once the agent holds
    # more than ``busy_connections`` in all, idle keep-alive connections are cut after
    # ``busy_keepalive_s`` instead of ``keepalive_timeout_s``.
    max_connections_per_client: int = 1024
    busy_connections: int = 3072
    busy_keepalive_s: float = 5.0
    request_timeout_s: float = 30.0  # a request's head and body must arrive within this
    keepalive_timeout_s: float = 75.0  # idle time between requests on a connection
    # After an early error (413 while the body still arrives), read and drop at most this much
    # of what the client still sends, for at most this long, before closing (nginx's lingering
    # close): closing on unread bytes resets the connection, and the client loses our answer.
    linger_s: float = 5.0
    linger_max_bytes: int = 256 * 1024 * 1024
    connect_timeout_s: float = 3.0
    # Until the response head: long, because a non-streamed answer of a reasoning model only
    # starts when it is complete. A node that goes DOWN or dead meanwhile is given up at once.
    first_byte_timeout_s: float = 1800.0
    stream_idle_timeout_s: float = 600.0  # between body bytes of a response
    max_attempts: int = 3
    # The poison-request guard: a request whose attempts ended with this many engines failing
    # on it (``failure.Failed.engine_failure``: broken, no answer, the node went down) is not
    # tried on more nodes. One failure is an engine's bad luck and worth one more node; two are
    # likely the request, which would otherwise take down every replica of its model in turn.
    max_engine_failures: int = 2
    retry_budget_s: float = 60.0
    eject_base_s: float = 2.0
    eject_max_s: float = 60.0
    hold_max_s: float = 2.0  # pending-aware policy: longest an ingress holds a request
    retry_after_s: int = 1
    policy: str = routing.DEFAULT_POLICY
    # Timeouts, DOWN nodes and clients that went away are noticed within this (per hop).
    watchdog_interval_s: float = 0.25
    # A stream whose node dies mid-answer continues on another node (dataplane/resume.py), at
    # most this many times per request (0: never); the bytes kept to do so, across all streams.
    max_resumes: int = 3
    resume_buffer_bytes: int = 256 * 1024 * 1024
    forward_max_skew_s: float = 30.0
    # Scale from zero: requests for a declared model with no replica wait (each for its
    # service's hold time) while one starts; at most this many at once across all models,
    # and a waiting stream gets an SSE comment this often so that nothing times it out.
    max_waiting_for_replica: int = 1024
    replica_keepalive_s: float = 10.0
    # Priority tiers (``tiers``): a batch request (X-Fabric-Priority: batch) goes to a node only
    # while a fresh load report shows its KV usage below ``batch_kv_threshold`` and at most
    # ``batch_max_waiting`` requests queued, and fewer than ``batch_max_inflight_per_node`` of
    # our batch requests in flight to it (without a fresh report: one). Otherwise it waits at
    # the ingress, at most ``max_batch_waiting`` of them in all, each for at most
    # ``batch_max_wait_s`` (then 503). Attempts to a node whose engine schedules by priority
    # carry ``"priority": batch_priority`` (interactive requests: vLLM's default, 0).
    # 0.7: with interactive routing that leaves batch work out of its scores, the batch tier
    # costs the interactive p95 ~2% here and takes ~75% of the idle capacity; 0.6 (SageServe's)
    # left a third of it idle (docs/benchmarks-history.md, "Priority tiers").
    batch_kv_threshold: float = 0.7
    batch_max_waiting: int = 0
    # 32: with the prefill clocks pacing batch prompts, the KV threshold is what binds; a
    # smaller cap only leaves capacity idle (docs/benchmarks-history.md, "Priority tiers").
    batch_max_inflight_per_node: int = 32
    max_batch_waiting: int = 4096
    batch_max_wait_s: float = 600.0
    batch_priority: int = 1
    # Pacing (0: off): each node is sent at most this many batch prompt tokens per second, one
    # request at a time (a request of T tokens holds the next one back T / rate seconds), so
    # batch prefills do not pile into one engine step while interactive requests arrive.
    batch_prefill_tokens_per_s: float = 0.0
    # Yielding (``gate.BatchGate.pressure``): when a fresh report shows a node's engine queueing
    # requests with its KV usage at ``batch_preempt_kv_threshold`` or more, this ingress takes
    # back its newest batch requests there that have no answer yet (the engine aborts them and
    # frees their KV), at most ``batch_preempt_per_report`` per report, and they wait in the
    # gate again; a request is taken back at most ``batch_max_preemptions`` times. 1.0: never.
    batch_preempt_kv_threshold: float = 0.9
    batch_preempt_per_report: int = 4
    batch_max_preemptions: int = 3
