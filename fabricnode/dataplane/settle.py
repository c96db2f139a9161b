"""Settling: the bookkeeping of answered requests, deferred off the client's path.

Once a response is out, a request still has to be counted (metrics by model and status, time to
first token, tokens read from the response's ``usage``), charged to its API key (the usage
ledger) and written to the request log. Doing that at once would hold up the client's next
request on its connection; ``Settler`` queues the answered ``Job`` and does it at a moment the
data plane would wait anyway (see ``Settler.settle``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from fabricnode.dataplane.endpoints import FORM_KINDS, NO_USAGE_KINDS
from fabricnode.dataplane.job import Job
from fabricnode.dataplane.metrics import IngressMetrics
from fabricnode.dataplane.recent import RecentStats
from fabricnode.dataplane.sockio import LoopClock
from fabricnode.dataplane.tiers import BATCH, INTERACTIVE
from fabricnode.dataplane.usage import (
    StreamUsage,
    UsageLedger,
    audio_seconds_from_json,
    usage_from_json,
)
from fabricnode.requestlog.format import opt_int
from fabricnode.requestlog.writer import RequestLog

log = logging.getLogger("fabricnode.dataplane.settle")

# Answered requests whose bookkeeping waits: how many at most, and how long while none come.
MAX_UNSETTLED = 256
SETTLE_INTERVAL_S = 0.5


class Settler:
    """Answered requests, not yet settled, and how to settle them."""

    def __init__(
        self,
        metrics: IngressMetrics,
        ledger: UsageLedger,
        request_log: RequestLog | None,
        wall_clock: Callable[[], float],
        clock: LoopClock,
    ) -> None:
        self.metrics = metrics
        self.ledger = ledger
        self.request_log = request_log
        self.wall_clock = wall_clock
        self.clock = clock
        self.finished: deque[Job] = deque()
        # The last minutes per model, for the dashboard (``GET /fabric/v1/stats``).
        self.recent = RecentStats()

    def answered(self, job: Job, candidates: int, now: float) -> None:
        """The request is answered at ``now``: queue it; settle at once when the queue is full."""
        job.ended = now
        job.candidates = candidates
        finished = self.finished
        finished.append(job)
        if len(finished) >= MAX_UNSETTLED:
            self.settle()

    def settle(self) -> None:
        """The bookkeeping of every request answered since the last call: metrics, usage (read
        from the response), the ledger and the request log.

        Deferred from the answer, which would otherwise hold up the client's next request on
        its connection, to moments the data plane would spend waiting anyway: just after a
        request went to its engine, while the engine works on it (``UpstreamPool.while_waiting``).
        Also before anything reads what it updates (``Ingress.render_metrics``, the request log's
        flush), every ``SETTLE_INTERVAL_S`` while no request comes, and at most
        ``MAX_UNSETTLED`` requests late.
        """
        finished = self.finished
        if not finished:
            return
        wall_offset = self.wall_clock() - self.clock.now()
        while finished:
            job = finished.popleft()
            try:
                self._settle_one(job, wall_offset)
            except Exception:  # one request's bookkeeping must not fail the one that runs it
                log.exception("bookkeeping of an answered request failed")

    def _settle_one(self, job: Job, wall_offset: float) -> None:
        if job.response is not None:
            if job.kind not in NO_USAGE_KINDS:
                count_tokens(job, job.response, job.response_sse)
            job.response = None
        if job.candidates >= 0:
            self.metrics.candidates.observe((), job.candidates)
        latency = job.ended - job.started
        status = job.status or 499
        self.metrics.done(job.model, status, latency)
        if job.ttft_s is not None:
            self.metrics.first_token(job.model, job.ttft_s)
        self.metrics.count_tokens(job.model, job.prompt_tokens, job.completion_tokens)
        self.metrics.count_endpoint(job.kind, status, job.prompt_tokens, job.completion_tokens)
        batch = job.slot is not None
        tier = BATCH if batch else INTERACTIVE
        self.metrics.tier_requests.inc((tier,))
        if job.audio_s:
            self.metrics.audio_seconds.inc((job.model,), job.audio_s)
        self.recent.add(
            job.started + wall_offset,
            job.model,
            status,
            latency,
            job.ttft_s,
            job.prompt_tokens,
            job.completion_tokens if status == 200 else 0,
            batch,
        )
        name = job.key.name if job.key is not None else "anonymous"
        self.ledger.record(
            name, job.model, job.prompt_tokens, job.completion_tokens, error=status >= 400
        )
        if self.request_log is not None:
            max_tokens: int | None = None
            temperature: float | None = None
            doc = job.doc
            if doc is not None:
                max_tokens = opt_int(
                    doc.get("max_tokens")
                    or doc.get("max_completion_tokens")
                    or doc.get("max_output_tokens")  # the Responses API's name
                )
                value = doc.get("temperature")
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    temperature = float(value)
            # A tuple in TraceRecord's field order: the record is built in the flush thread.
            self.request_log.append(
                (
                    job.started + wall_offset,
                    job.model,
                    job.prompt_tokens or None,
                    job.completion_tokens if status == 200 else None,
                    latency,
                    job.ttft_s,
                    status,
                    job.served_by,
                    name,
                    job.stream,
                    max_tokens,
                    temperature,
                    job.kind,
                    tier,
                    job.site if job.served_by else "",
                )
            )


def count_tokens(job: Job, body: list[bytes], sse: bool) -> None:
    """Token counts from a whole response body's usage."""
    if sse:
        usage = StreamUsage()
        for piece in body:
            usage.feed(piece)
        prompt, completion = usage.result()
        job.prompt_tokens, job.completion_tokens = prompt or 0, completion
    elif job.status == 200:
        whole = b"".join(body)
        found = usage_from_json(whole)
        if found is not None:
            job.prompt_tokens, job.completion_tokens = found
        elif job.kind in FORM_KINDS:
            job.audio_s = audio_seconds_from_json(whole) or 0.0
