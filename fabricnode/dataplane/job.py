"""``Job``: the state of a routed request's attempts, from routing to settling; and
``BatchSlot``, the part only a batch-tier request has."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fabricnode.dataplane.keytable import ApiKey
from fabricnode.dataplane.resume import Splicer, Transcript


class BatchSlot:
    """A batch-tier request's state (``tiers``, ``gate``): made for batch requests only, so an
    interactive request carries none of it (``Job.slot`` is None)."""

    __slots__ = ("booked", "node", "preemptions", "tenant", "unprioritized")

    def __init__(self, tenant: str) -> None:
        # Queued under ``tenant``: its key's id, "-" without one, or the owner header's.
        self.tenant = tenant
        # The node its current attempt holds a batch slot on (None: none).
        self.node: str | None = None
        # The node whose prefill clock the batch gate already moved for it when it admitted it
        # there (None: not booked); its first attempt there does not count it again.
        self.booked: str | None = None
        self.preemptions = 0  # times the batch gate took it back from a node
        # While an attempt's body carries the engine priority, the body without it.
        self.unprioritized: bytes | None = None


class Job:
    """The state of one routed request's attempts.

    A plain class, not a dataclass: one is made per request, and the compiled data plane
    runs a plain class's ``__init__`` natively (a dataclass's generated one stays interpreted).
    """

    __slots__ = (
        "audio_s",
        "body",
        "candidates",
        "close",
        "completion_tokens",
        "content_type",
        "cross",
        "doc",
        "ended",
        "from_site",
        "headers",
        "held_head",
        "http10",
        "key",
        "kind",
        "last_event",
        "method",
        "model",
        "out",
        "path",
        "prefill_tokens",
        "prompt_tokens",
        "response",
        "response_id",
        "response_owner",
        "response_sse",
        "resumes",
        "retag",
        "served_by",
        "site",
        "sites",
        "slot",
        "splice",
        "started",
        "status",
        "stream",
        "transcript",
        "ttft_s",
        "waking",
    )

    def __init__(
        self,
        kind: str,
        model: str,
        stream: bool,
        body: bytes,
        path: bytes,
        headers: Mapping[bytes, bytes],
        key: ApiKey | None,
        started: float,
        doc: dict[str, Any] | None = None,
    ) -> None:
        self.kind = kind  # the endpoint's kind (``endpoints.ENDPOINTS``), or "forward"
        self.model = model
        self.stream = stream
        self.body = body
        self.path = path  # the target sent upstream (a path; with its query only where kept)
        # The upstream request's method and content type (a form keeps its client's boundary).
        self.method = b"POST"
        self.content_type = b"application/json"
        self.headers = headers
        self.key = key
        self.started = started
        # The parsed body: the request log's fields are read from it once the answer is out.
        self.doc = doc
        self.http10 = False  # an HTTP/1.0 client: no chunked coding, the body ends at close
        self.close = False  # the client connection must close after this response
        self.served_by = ""
        # The site of the node of the latest attempt: the serving node's once served_by is set.
        self.site = ""
        # The sites that may serve it (``residency``; None: any): a forward carries them.
        self.sites: frozenset[str] | None = None
        # Cross-site (``sites``): the peer site this request came from over the federation
        # link ("" from a client of ours); whether a gateway is taking it out of the site
        # (``out``: to peer sites only); whether the latest attempt went through a gateway.
        self.from_site = ""
        self.out = False
        self.cross = False
        self.status = 0
        self.ttft_s: float | None = None
        # Its prompt's estimated tokens, counted on the prefill clock of each node it goes to
        # (``prefill``); 0 for kinds without a prompt to prefill.
        self.prefill_tokens = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.audio_s = 0.0  # seconds of audio a transcription or translation reported
        # Set when the answer is out; the rest of the bookkeeping waits for ``Settler.settle``.
        self.ended = 0.0
        self.candidates = -1  # eligible nodes for the first attempt (-1: not routed)
        # A whole response body whose usage is read at settling (None: nothing to read).
        self.response: list[bytes] | None = None
        self.response_sse = False
        # A stream resumed on another node (``resume``): what the client received so far, the
        # rewriter of the continuation's events (set while continuing), and how many resumes.
        self.transcript: Transcript | None = None
        self.splice: Splicer | None = None
        self.resumes = 0
        # A stream held while a replica started: its 200 SSE head is out already, so the first
        # node's events follow it as they come (no head of theirs), and a failure is an event.
        self.held_head = False
        # Routed to sleeping replicas (the model had no awake one): tried in the route
        # table's order, not ranked, so ingresses wake the same one.
        self.waking = False
        # A ``POST /v1/responses``: each attempt sets the body's ``request_id`` to a response
        # id naming the node tried (``endpoints.response_id``), kept in ``response_id``.
        self.retag = False
        self.response_id: str | None = None
        # Whose it is when it came from another site (``responses.site_owner``): the id names
        # that owner and our site; None: the caller's key (or no owner with keys off).
        self.response_owner: str | None = None
        # The data of the last event relayed of a stream that broke (its error event follows).
        self.last_event: bytes | None = None
        # The batch tier (``tiers``): held at the ingress until a node has room (None: an
        # interactive request).
        self.slot: BatchSlot | None = None
