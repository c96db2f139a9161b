"""One attempt's exchange with a node, and its answer relayed to the client.

``Relay.exchange`` sends the request built for the node (``upstream_request``) on a pooled
connection (``upstream.Exchange``) and relays the answer piece by piece as it arrives, unbuffered
and never re-encoded: a short answer that came whole with its head goes out in one send, a body
still coming is sent as it comes (``_relay_body``). Before the first byte reaches the client,
an attempt that failed returns why (a string) and the ingress tries the next node
(``Ingress._dispatch``: failover, the circuit breaker). After it:

* A chat or completion stream that breaks is resumed on another node (``resume``) where that
  can be faithful: the attempt returns ``failure.RESUMED`` with the continuation on the job. A
  stream that broke before its first event goes whole to another node (``_resend_whole``).
  Otherwise a stream ends with well-formed error event(s) in its endpoint's format
  (``endpoints.stream_error_events``) and the terminating chunk (``end_stream``), and any other
  broken body closes the connection. A request we serve for another ingress breaks its stream
  too, so that the ingress holding the client resumes or ends it.
* A client that goes away aborts its upstream request (the exchange is closed unfinished).

What it counts while an attempt is in flight: our requests per node (``remote_inflight``, read
by routing's load scores), those to our own engine (``local_inflight``, which the engine service
publishes as the node's ``inflight`` load), and the prompt
on the node's prefill clock (``prefill``): a stream's first token corrects the clock when it
comes late, and one sent to a node with nothing ahead samples the node's prefill rate. An
attempt ending wakes the requests the pending-aware hold keeps (``release``) and a leaving
node's drain (``wait_inflight_change``). At the drain's deadline ``hand_over`` breaks off the
exchanges with our own engine still running: each ends as if the engine had failed, so the
ingress holding the client resumes the stream on another node (or, for a request we serve for
another ingress, breaks it for that ingress to resume).

The ingress reaches ``exchange`` through ``attempt.Attempts``, which returns its coroutine
rather than awaiting it: no level of ``await`` is added on the way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from fabricnode.dataplane import failure
from fabricnode.dataplane.clientconn import ClientConn, ClientGone, client_send, send_now, send_rest
from fabricnode.dataplane.endpoints import (
    RESENDABLE_KINDS,
    RESUMABLE_KINDS,
    last_sequence_number,
    stream_error_events,
)
from fabricnode.dataplane.failure import Failed
from fabricnode.dataplane.forward_auth import HEADER as FORWARD_HEADER
from fabricnode.dataplane.gatewait import GateWaits
from fabricnode.dataplane.http1 import frame, status_line
from fabricnode.dataplane.ingress_config import IngressConfig
from fabricnode.dataplane.job import Job
from fabricnode.dataplane.metrics import IngressMetrics
from fabricnode.dataplane.prefill import PrefillClocks
from fabricnode.dataplane.request import error_body
from fabricnode.dataplane.residency import SITES_HEADER
from fabricnode.dataplane.resume import (
    RESUME_HEADER,
    Delivered,
    Splicer,
    Transcript,
    TranscriptBudget,
    plan_continuation,
    turned_off,
)
from fabricnode.dataplane.sites import SITE_HEADER
from fabricnode.dataplane.sockio import LoopClock, Watchdog
from fabricnode.dataplane.upstream import (
    BrokenResponse,
    Exchange,
    Origin,
    UpstreamError,
    UpstreamPool,
)
from fabricnode.dataplane.usage import StreamUsage

log = logging.getLogger("fabricnode.dataplane.relay")

RETRYABLE_STATUS = (502, 503, 504)
# Request headers passed on to the upstream (anything else stays at the ingress).
FORWARDED_REQUEST_HEADERS = (b"accept", b"x-request-id", b"openai-organization")
SSE = b"text/event-stream"


def upstream_request(
    job: Job,
    origin: Origin,
    *,
    forward: bytes | None,
    sites: bytes | None = None,
    extra: bytes = b"",
) -> bytes:
    """The request sent to ``origin`` for ``job`` (``forward``: the signed header of an
    agent-to-agent forward, with ``sites``, the allowed sites it carries, None: any; None to
    our own engine), with its body; ``extra``: header lines of our own (a cross-site hop's,
    ``attempt``). The client's credentials never go on: a forward is authenticated by the
    cluster key, and the key's limits travel as the allowed sites."""
    lines = [
        b"%s %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: %s\r\ncontent-length: %d\r\n"
        % (job.method, job.path, origin[0].encode(), origin[1], job.content_type, len(job.body))
    ]
    headers = job.headers
    for name in FORWARDED_REQUEST_HEADERS:
        value = headers.get(name)
        if value is not None:
            lines.append(name + b": " + value + b"\r\n")
    if forward is not None:
        lines.append(FORWARD_HEADER + b": " + forward + b"\r\n")
        if sites is not None:
            lines.append(SITES_HEADER + b": " + sites + b"\r\n")
        session = headers.get(b"x-session-id")
        if session is not None:
            lines.append(b"x-session-id: " + session + b"\r\n")
    if extra:
        lines.append(extra)
    lines.append(b"\r\n")
    lines.append(job.body)
    return b"".join(lines)


def response_head(conn: ClientConn, job: Job, ex: Exchange, sid: str) -> tuple[bytes, bool]:
    """Our response head for the upstream's, and whether the body goes out chunked."""
    length = ex.content_length
    chunked = length is None
    if ex.bodiless:
        chunked = False  # 204 and 304 end with their head: no length, no chunks
        framing = b""
    elif length is not None:
        framing = b"content-length: %d\r\n" % length
    elif job.http10:
        # HTTP/1.0 has no chunked coding: send the body as it comes, end it by closing.
        chunked = False
        conn.closing = True
        framing = b""
    else:
        framing = b"transfer-encoding: chunked\r\n"
    if conn.closing:
        framing += b"connection: close\r\n"
    if job.cross or job.from_site:
        # A cross-site answer names the site that served it (the ingress that sent the
        # request out learns it from here, for its request log).
        framing += SITE_HEADER + b": " + job.site.encode() + b"\r\n"
    parts = (
        status_line(job.status),
        ex.end_to_end,
        b"x-fabric-node: ",
        sid.encode(),
        b"\r\n",
        framing,
        b"\r\n",
    )
    return b"".join(parts), chunked


def served_across(job: Job, ex: Exchange) -> None:
    """An answer that came through a gateway: the node and site it names served it."""
    node = ex.fabric_node
    if node:
        job.served_by = node.decode("ascii", "replace")
    site = ex.fabric_site
    if site:
        job.site = site.decode("ascii", "replace")


class Relay:
    """The exchanges of the ingress's attempts, and what they count while in flight."""

    def __init__(
        self,
        *,
        config: IngressConfig,
        clock: LoopClock,
        wall_clock: Callable[[], float],
        pool: UpstreamPool,
        watchdog: Watchdog,
        metrics: IngressMetrics,
        prefill: PrefillClocks,
        gate_waits: GateWaits,
    ) -> None:
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.pool = pool
        self.watchdog = watchdog
        self.metrics = metrics
        self.prefill = prefill
        self.gate_waits = gate_waits  # told when a batch request's answer is coming
        self.transcripts = TranscriptBudget(config.resume_buffer_bytes)
        self.remote_inflight: dict[str, int] = {}  # session id -> our requests in flight to it
        self.local_inflight = 0  # requests in flight to our own engine
        self.local_served = 0  # requests sent to our own engine, ever (its idle clock)
        self.broken_streams = 0
        # Exchanges with our own engine (``hand_over`` breaks them off).
        self._local: set[Exchange] = set()
        self._changed: trio.Event | None = None  # for wait_inflight_change, made on demand
        # Requests the pending-aware hold keeps (``Ingress._hold``) wait on ``released``, set
        # (and replaced) when an attempt ends while any is held.
        self.holders = 0
        self.released = trio.Event()

    def release(self) -> None:
        """Wake the held requests (an attempt ended, or the mesh changed): they look again."""
        if self.holders:
            released, self.released = self.released, trio.Event()
            released.set()

    async def wait_inflight_change(self) -> None:
        """Return once an attempt ended, or a request was answered (``notify``)."""
        if self._changed is None:
            self._changed = trio.Event()  # set by exchange when an attempt ends
        await self._changed.wait()

    def notify(self) -> None:
        """Wake ``wait_inflight_change``."""
        changed = self._changed
        if changed is not None:
            self._changed = None
            changed.set()

    def hand_over(self) -> int:
        """Break off every exchange with our own engine (module docstring); how many."""
        expire = self.watchdog.expire
        n = 0
        for ex in list(self._local):
            watch = ex.watch
            if watch is not None and ex.sock is not None:
                expire(watch, failure.HANDED_OVER)
                n += 1
        return n

    async def exchange(
        self,
        conn: ClientConn,
        job: Job,
        origin: Origin,
        request: bytes,
        sid: str,
        still_wanted: Callable[[], bool] | None,
        now: float,
        *,
        local: bool,
    ) -> Failed | None:
        """One attempt on ``origin``, counted in flight (``local``: to our own engine): None
        when the client has its answer, else what failed (``failure``)."""
        cfg = self.config
        inflight = self.remote_inflight
        if local:
            self.local_inflight += 1
            self.local_served += 1
        else:
            inflight[sid] = inflight.get(sid, 0) + 1
        # On the node's prefill clock. A stream's first token corrects the clock when it comes
        # late; one sent to an idle clock also samples the node's rate.
        tokens = job.prefill_tokens
        slot = job.slot
        timed = sample = False
        sent_at = due = 0.0
        if tokens:
            prefill = self.prefill
            sent_at = self.clock.now()
            if slot is not None and slot.booked == sid:  # the batch gate put it on the clock
                was_idle = False
            else:
                was_idle = prefill.sent(sid, tokens, sent_at, slot is not None)
            if slot is not None:
                slot.booked = None
            timed = job.stream and job.ttft_s is None
            if timed:
                due = prefill.due(sid)
                # A batch prompt's first token also waits for interactive ones: no sample.
                sample = was_idle and slot is None
        ex = Exchange(self.pool, self.watchdog, origin)
        if local:
            self._local.add(ex)
        try:
            try:
                await ex.start(
                    request,
                    connect_timeout_s=cfg.connect_timeout_s,
                    first_byte_timeout_s=cfg.first_byte_timeout_s,
                    still_wanted=still_wanted,
                    now=now,
                    client=conn.sock,
                )
            except UpstreamError as exc:
                failed = Failed(exc.kind, str(exc))
                if tokens and not failed.sent:  # no engine got the prompt
                    self.prefill.unsent(sid, tokens, sent_at, self.clock.now(), slot is not None)
                return failed
            except ClientGone:
                self.metrics.client_disconnects.labels("waiting").inc()
                raise
            if slot is not None:
                self.gate_waits.answered(job, sid)  # its answer is coming: it runs to the end
            try:
                status = ex.status
                if tokens and status >= 400:
                    # Answered with an error (at once, for a model it lacks or a prompt too
                    # long): nothing was prefilled, so the prompt's slot is given back.
                    self.prefill.unsent(sid, tokens, sent_at, self.clock.now(), slot is not None)
                if status in RETRYABLE_STATUS:
                    return failure.answered(status)
                if not local and not job.cross:
                    answering = ex.fabric_node
                    if answering and answering != sid.encode():
                        # another agent at the node's address (the port a new agent took): it
                        # refused a forward signed for the node; try another
                        return Failed(
                            failure.MISDIRECTED,
                            f"answered by {answering[:8].decode('ascii', 'replace')}, not "
                            f"{sid[:8]}: the node's address is another agent's now",
                        )
                if job.splice is not None or job.held_head:
                    # A continuation, or a stream held for a replica: the client has its
                    # response head (and, continuing, part of the stream).
                    if status != 200 or not ex.content_type.startswith(SSE):
                        return Failed(
                            failure.HEAD_OUT,
                            f"the node answered {status} to a stream whose head is out",
                        )
                    job.served_by = sid
                    if job.cross:
                        served_across(job, ex)
                    return await self._relay_body(conn, job, ex, sid, b"", True)
                job.status = status
                job.served_by = sid
                if job.cross:
                    served_across(job, ex)
                head, chunked = response_head(conn, job, ex, job.served_by)
                if not ex.complete:
                    return await self._relay_body(conn, job, ex, sid, head, chunked)
                # The whole response came with its head (any short JSON answer): one send, no
                # coroutine for the body.
                pieces = ex.take_pieces()
                if pieces and job.stream:
                    job.ttft_s = self.clock.now() - job.started
                out = head + frame(pieces, chunked) if pieces else head
                if chunked:
                    out += b"0\r\n\r\n"
                sent = send_now(conn, out)
                if sent < len(out):
                    await send_rest(conn, out, sent, cfg.stream_idle_timeout_s)
                # Usage is read when the request is settled, off the client's path.
                job.response = pieces
                job.response_sse = ex.content_type.startswith(SSE)
                return None
            except ClientGone:
                self.metrics.client_disconnects.labels("relaying").inc()
                raise
            finally:
                ex.finish()  # closes an unfinished exchange: the engine aborts the request
        finally:
            if timed and job.ttft_s is not None:
                first_at = job.started + job.ttft_s
                self.prefill.first_token(sid, due, first_at)
                if sample:
                    self.prefill.observe(sid, tokens, first_at - sent_at)
            if local:
                self.local_inflight -= 1
                self._local.discard(ex)
            else:
                n = inflight.get(sid, 1) - 1
                if n > 0:
                    inflight[sid] = n
                else:
                    inflight.pop(sid, None)
            self.notify()
            self.release()

    async def _relay_body(
        self, conn: ClientConn, job: Job, ex: Exchange, sid: str, head: bytes, chunked: bool
    ) -> Failed | None:
        """Relay a body that is still coming, piece by piece as it arrives. None when the
        client got its answer; ``failure.RESUMED`` when the stream broke and a continuation is
        ready."""
        cfg = self.config
        sse = ex.content_type.startswith(SSE)
        pieces = ex.take_pieces()
        usage = StreamUsage() if sse else None
        collected: list[bytes] | None = None if sse else []
        # What the client receives of a stream, kept (bounded) to resume it on another node.
        transcript = job.transcript
        # Only chat and completions resume: the other kinds end with their error event.
        if (
            transcript is None
            and sse
            and chunked
            and job.stream
            and cfg.max_resumes > 0
            and job.kind in RESUMABLE_KINDS
        ):
            job.transcript = transcript = Transcript(self.transcripts)
        splice = job.splice  # set when this is a continuation: its events are rewritten
        first = True
        idle_s = cfg.stream_idle_timeout_s
        while True:
            if splice is not None:
                pieces = splice.feed(pieces)
            if pieces:
                if first and job.stream and job.ttft_s is None:
                    job.ttft_s = self.clock.now() - job.started
                first = False
                out = frame(pieces, chunked)
            else:
                out = b""
            if head:
                out = head + out
                head = b""
            complete = ex.complete
            if complete and chunked:
                out += b"0\r\n\r\n"
            if out:
                sent = send_now(conn, out)
                if sent < len(out):
                    await send_rest(conn, out, sent, idle_s)
            # Usage is read after the piece went out, not on its way to the client.
            if usage is not None:
                for piece in pieces:
                    usage.feed(piece)
                if transcript is not None:
                    transcript.add(pieces)
            elif collected is not None:
                collected.extend(pieces)
            if complete:
                break
            try:
                await ex.read_more(cfg.stream_idle_timeout_s)
            except BrokenResponse as exc:
                self.broken_streams += 1
                self.metrics.broken_streams.inc()
                log.warning("response from %s broke mid-stream: %s", sid[:8], exc)
                if job.kind == "forward":
                    # We serve another ingress: break its stream too, so that the ingress that
                    # holds the client resumes it elsewhere or ends it (it knows the client).
                    job.close = True
                    conn.closing = True
                    return None
                if sse and chunked:
                    if first and self._resend_whole(job, sid):
                        return failure.RESUMED
                    if transcript is not None and self._prepare_resume(job, transcript, sid):
                        return failure.RESUMED
                    if transcript is None and job.stream and job.kind not in RESUMABLE_KINDS:
                        self.metrics.stream_resumes.labels("not_resumable").inc()
                    if usage is not None:
                        job.last_event = usage.last_event  # a Responses event's sequence
                    job.status = 502 if job.status < 400 else job.status
                    # The client gets a complete, well-framed response (error event, last
                    # chunk): the connection stays usable, and the client may already have
                    # sent its next request on it.
                    await self.end_stream(conn, job, f"the serving node failed mid-stream: {exc}")
                    return None
                job.status = 502 if job.status < 400 else job.status
                # A body with a length (or no framing) cannot be ended early: close.
                job.close = True
                conn.closing = True
                return None
            pieces = ex.take_pieces()
        if usage is not None:
            prompt, completion = usage.result()
            if splice is not None and not usage.reported:
                completion += splice.got.tokens  # counted events: the first node's too
            job.prompt_tokens, job.completion_tokens = prompt or 0, completion
        elif collected is not None:
            job.response = collected
        return None

    async def end_stream(
        self, conn: ClientConn, job: Job, message: str, code: str = "upstream_broken"
    ) -> None:
        """End a stream the client holds with the error event(s) of its endpoint's format
        (``endpoints.stream_error_events``) and the last chunk."""
        status = 503 if code == "replica_starting" else 502
        after = last_sequence_number(job.last_event)
        events = stream_error_events(
            job.kind,
            status,
            message,
            code,
            error_body(status, message, code),
            response_id=job.response_id,
            model=job.model,
            sequence_number=0 if after is None else after + 1,
            created_at=int(self.wall_clock()),
        )
        await client_send(
            conn, frame([events], True) + b"0\r\n\r\n", self.config.stream_idle_timeout_s
        )

    def _resend_whole(self, job: Job, sid: str) -> bool:
        """A stream that broke before its first event reached the client (the node sent its
        head and died): True when the request goes whole to another node, whose events pass
        as they come, or through the splicer of the continuation this already was."""
        if (
            job.kind not in RESENDABLE_KINDS
            or job.resumes >= self.config.max_resumes
            or turned_off(job.headers.get(RESUME_HEADER))
        ):
            return False
        got = job.splice.got if job.splice is not None else Delivered()
        job.splice = Splicer(got, job.kind)  # fresh: nothing half-read of the dead node's bytes
        job.resumes += 1
        log.info("stream from %s broke before its first event: sent again whole", sid[:8])
        return True

    def _prepare_resume(self, job: Job, transcript: Transcript, sid: str) -> bool:
        """Make the continuation of a broken stream (``resume``): True if there is one."""
        plan = plan_continuation(
            job.kind,
            job.doc,
            job.headers.get(RESUME_HEADER),
            transcript,
            resumes_left=self.config.max_resumes - job.resumes,
        )
        if isinstance(plan, str):
            self.metrics.stream_resumes.labels("not_resumable").inc()
            log.info("stream from %s not resumed: %s", sid[:8], plan)
            return False
        job.body, job.splice = plan
        if job.slot is not None:  # the continuation's body: without the priority field
            job.slot.unprioritized = None
        job.resumes += 1
        return True
