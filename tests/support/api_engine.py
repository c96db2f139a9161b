"""A stand-in engine for the data plane's endpoint tests: every model-addressed endpoint vLLM
serves, answered with canned bodies and streams, run in the test's own process.

``ApiEngine`` owns its listening socket from the start (no port can be taken between choosing
and binding it) and serves HTTP/1.1 keep-alive connections, one thread each. It answers what an
agent's engine supervision asks (``/health``, ``/v1/models``, ``/metrics``, ``/version``) and
the data plane's endpoints in each one's own format:

* JSON answers with each endpoint's usage: chat/completions/embeddings/score/pooling/classify
  ``prompt_tokens``/``completion_tokens``, rerank ``prompt_tokens``/``total_tokens``, Responses
  and Anthropic Messages ``input_tokens``/``output_tokens``, transcriptions the audio duration.
* Streams (``"stream": true``) in each format: chat chunks, Responses events (``event:`` lines,
  ``sequence_number``, the usage in ``response.completed``), Anthropic Messages events (usage
  in ``message_start`` and ``message_delta``). A body with ``"stub_break_after": N`` gets its
  first N events and then a closed connection (no terminating chunk): a node failing
  mid-stream; one with ``"stub_fail_first": TOKEN`` is answered 503 by the first engine (of
  all in the process) that sees that token: a node failing before the first byte; one with
  ``"stub_crash": true`` gets its connection closed with no answer from every engine: a request
  that makes engines fail.
* Responses as vLLM 0.32 stores them: the response's id is the request's ``request_id`` (else
  a random ``resp_`` id); ``GET /v1/responses/{id}`` and ``POST .../cancel`` answer the stored
  one or vLLM's 404; a ``previous_response_id`` it does not hold is a 404.

Every request is recorded (``seen``: method, target, headers, body, and the bytes of the answer
it sent) so a test can tell which node got what, byte for byte.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

ENGINE_VERSION = "0.32.0-stub"
_FAILED: set[str] = set()  # the ``stub_fail_first`` tokens some engine failed already
_FAILED_LOCK = threading.Lock()
TOKENS = ["Hello", " from", " the", " stub"]


@dataclass
class Seen:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    head: bytes  # the request line and headers as received
    sent: bytes = b""  # the answer's body as sent (SSE bytes for a stream)


@dataclass
class ApiEngine:
    name: str
    models: tuple[str, ...] = ("m1",)
    seen: list[Seen] = field(default_factory=list)
    responses: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def requests(self, path: str | None = None) -> list[Seen]:
        """What it received (on ``path``, without the query), oldest first."""
        with self._lock:
            seen = list(self.seen)
        return [s for s in seen if path is None or s.target.partition("?")[0] == path]

    # -- connections -----------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            try:
                while True:
                    while b"\r\n\r\n" not in buf:
                        data = conn.recv(65536)
                        if not data:
                            return
                        buf += data
                    head, buf = buf.split(b"\r\n\r\n", 1)
                    lines = head.decode("latin-1").split("\r\n")
                    method, target, _ = lines[0].split(" ", 2)
                    headers: dict[str, str] = {}
                    for line in lines[1:]:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                    length = int(headers.get("content-length", "0"))
                    while len(buf) < length:
                        data = conn.recv(1 << 20)
                        if not data:
                            return
                        buf += data
                    body, buf = buf[:length], buf[length:]
                    seen = Seen(method, target, headers, body, head)
                    with self._lock:
                        self.seen.append(seen)
                    if not self._answer(conn, seen):
                        return
            except OSError:
                return

    # -- answers ---------------------------------------------------------------------------

    def _answer(self, conn: socket.socket, seen: Seen) -> bool:
        """Answer one request; False when the connection was closed on purpose."""
        path = seen.target.partition("?")[0]
        if seen.method == "GET":
            if path == "/health":
                return _send_json(conn, seen, 200, None)
            if path == "/v1/models":
                data = [
                    {"id": m, "object": "model", "max_model_len": 4096, "owned_by": "stub"}
                    for m in self.models
                ]
                return _send_json(conn, seen, 200, {"object": "list", "data": data})
            if path == "/metrics":
                return _send(conn, seen, 200, b"text/plain", b"")
            if path == "/version":
                return _send_json(conn, seen, 200, {"version": ENGINE_VERSION})
            if path.startswith("/v1/responses/"):
                return self._stored(conn, seen, path.removeprefix("/v1/responses/"), False)
            return _send_json(conn, seen, 404, _vllm_error(404, f"no route {path}"))
        if path.startswith("/v1/responses/") and path.endswith("/cancel"):
            rid = path.removeprefix("/v1/responses/").removesuffix("/cancel")
            return self._stored(conn, seen, rid, True)
        if path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            answer = {"text": "hello", "usage": {"type": "duration", "seconds": 3}}
            return _send_json(conn, seen, 200, answer)
        try:
            doc = json.loads(seen.body)
        except ValueError:
            return _send_json(conn, seen, 400, _vllm_error(400, "not JSON"))
        model = doc.get("model", "")
        stream = doc.get("stream") is True
        cut = doc.get("stub_break_after")
        breaker = doc.get("stub_break_first")
        if isinstance(breaker, str):
            with _FAILED_LOCK:  # only the first engine to see it breaks its stream
                if f"break:{breaker}" in _FAILED:
                    cut = None
                _FAILED.add(f"break:{breaker}")
        if doc.get("stub_crash") is True:
            return False  # closed with no answer: an engine that a request makes fail
        token = doc.get("stub_fail_first")
        if isinstance(token, str):
            with _FAILED_LOCK:  # the first engine, of all in this process, to see it fails
                first = token not in _FAILED
                _FAILED.add(token)
            if first:
                return _send_json(conn, seen, 503, _vllm_error(503, "stub failure"))
        if path == "/v1/responses":
            return self._create_response(conn, seen, doc, stream, cut)
        if path == "/v1/messages":
            if stream:
                return _stream(conn, seen, _messages_events(model), cut)
            return _send_json(conn, seen, 200, _message(model))
        if path == "/v1/messages/count_tokens":
            return _send_json(conn, seen, 200, {"input_tokens": 9})
        if path == "/v1/chat/completions":
            if stream:
                return _stream(conn, seen, _chat_events(model), cut)
            return _send_json(conn, seen, 200, _chat(model, self.name))
        canned = _canned(path, model)
        if canned is None:
            return _send_json(conn, seen, 404, _vllm_error(404, f"no route {path}"))
        return _send_json(conn, seen, 200, canned)

    def _create_response(
        self, conn: socket.socket, seen: Seen, doc: dict[str, Any], stream: bool, cut: Any
    ) -> bool:
        previous = doc.get("previous_response_id")
        if previous is not None and previous not in self.responses:
            return _send_json(conn, seen, 404, _not_found(previous))
        rid = doc.get("request_id") or f"resp_{uuid.uuid4().hex}"
        model = doc.get("model", "")
        response = {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "status": "completed",
            "previous_response_id": previous,
            "output": [
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [
                        {"type": "output_text", "text": "".join(TOKENS), "annotations": []}
                    ],
                }
            ],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": 7,
                "output_tokens": len(TOKENS),
                "total_tokens": 7 + len(TOKENS),
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
            "served_by": self.name,
        }
        with self._lock:
            self.responses[rid] = response
        if stream:
            return _stream(conn, seen, _responses_events(response), cut)
        return _send_json(conn, seen, 200, response)

    def _stored(self, conn: socket.socket, seen: Seen, rid: str, cancel: bool) -> bool:
        with self._lock:
            response = self.responses.get(rid)
            if response is not None and cancel:
                response = self.responses[rid] = {**response, "status": "cancelled"}
        if response is None:
            return _send_json(conn, seen, 404, _not_found(rid))
        return _send_json(conn, seen, 200, response)


# == formats =================================================================================


def _vllm_error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "NotFoundError", "param": None, "code": status}}


def _not_found(rid: str) -> dict[str, Any]:
    return {
        "error": {
            "message": f"Response with id '{rid}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }


def _chat(model: str, name: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": f"answered by {name}"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
    }


def _chat_events(model: str) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        doc = {
            "id": "chatcmpl-stub",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(doc).encode() + b"\n\n"

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": t}) for t in TOKENS]
    events.append(chunk({}, "stop"))
    events.append(b"data: [DONE]\n\n")
    return events


def _responses_events(response: dict[str, Any]) -> list[bytes]:
    pending = {**response, "status": "in_progress", "usage": None, "output": []}
    docs: list[dict[str, Any]] = [
        {"type": "response.created", "response": pending},
        {"type": "response.in_progress", "response": pending},
    ]
    for token in TOKENS:
        docs.append(
            {
                "type": "response.output_text.delta",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": token,
                "logprobs": [],
            }
        )
    docs.append({"type": "response.completed", "response": response})
    events = []
    for n, doc in enumerate(docs):
        doc = {**doc, "sequence_number": n}
        events.append(f"event: {doc['type']}\ndata: {json.dumps(doc)}\n\n".encode())
    return events


def _message(model: str) -> dict[str, Any]:
    return {
        "id": "msg_stub",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": "".join(TOKENS)}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 9, "output_tokens": len(TOKENS)},
    }


def _messages_events(model: str) -> list[bytes]:
    start = {**_message(model), "content": [], "stop_reason": None}
    start["usage"] = {"input_tokens": 9, "output_tokens": 1}
    docs: list[dict[str, Any]] = [
        {"type": "message_start", "message": start},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    ]
    for token in TOKENS:
        docs.append(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": token},
            }
        )
    docs.append({"type": "content_block_stop", "index": 0})
    docs.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": len(TOKENS)},
        }
    )
    docs.append({"type": "message_stop"})
    return [f"event: {d['type']}\ndata: {json.dumps(d)}\n\n".encode() for d in docs]


def _canned(path: str, model: str) -> dict[str, Any] | None:
    if path == "/v1/completions":
        return {
            "id": "cmpl-stub",
            "object": "text_completion",
            "model": model,
            "choices": [{"index": 0, "text": "".join(TOKENS), "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        }
    if path == "/v1/embeddings":
        return {
            "object": "list",
            "model": model,
            "data": [{"object": "embedding", "index": 0, "embedding": [0.0, 1.0]}],
            "usage": {"prompt_tokens": 2, "total_tokens": 2},
        }
    if path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        return {
            "id": "rerank-stub",
            "model": model,
            "usage": {"prompt_tokens": 11, "total_tokens": 11},
            "results": [{"index": 0, "document": {"text": "a"}, "relevance_score": 0.9}],
        }
    if path in ("/v1/score", "/score"):
        return {
            "id": "score-stub",
            "object": "list",
            "model": model,
            "data": [{"index": 0, "object": "score", "score": 0.5}],
            "usage": {"prompt_tokens": 5, "total_tokens": 5, "completion_tokens": 0},
        }
    if path in ("/pooling", "/classify"):
        return {
            "id": "pool-stub",
            "object": "list",
            "model": model,
            "data": [{"index": 0, "data": [0.1]}],
            "usage": {"prompt_tokens": 6, "total_tokens": 6, "completion_tokens": 0},
        }
    if path == "/tokenize":
        return {"count": 3, "max_model_len": 4096, "tokens": [1, 2, 3]}
    if path == "/detokenize":
        return {"prompt": "abc"}
    return None


# == the wire ================================================================================


def _send(conn: socket.socket, seen: Seen, status: int, content_type: bytes, body: bytes) -> bool:
    seen.sent = body
    head = b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
        status,
        content_type,
        len(body),
    )
    conn.sendall(head + body)
    return True


def _send_json(conn: socket.socket, seen: Seen, status: int, doc: Any) -> bool:
    body = b"" if doc is None else json.dumps(doc).encode()
    return _send(conn, seen, status, b"application/json", body)


def _stream(conn: socket.socket, seen: Seen, events: list[bytes], cut: Any) -> bool:
    """A chunked SSE answer, one chunk per event; cut after ``cut`` events (closed, no end)."""
    conn.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    if isinstance(cut, int):
        events = events[:cut]
    for event in events:
        seen.sent += event
        conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
    if isinstance(cut, int):
        conn.shutdown(socket.SHUT_RDWR)
        return False
    conn.sendall(b"0\r\n\r\n")
    return True
