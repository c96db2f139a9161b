"""A fast fake OpenAI backend for the router benchmark: no model, no delay, one process.

Serves what routers and the fabric agent ask of an engine:

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: non-stream JSON with ``usage``;
  with ``"stream": true`` an SSE stream (chunked transfer encoding) of ``CHUNKS`` content
  chunks, one usage chunk and ``data: [DONE]``, each event written to the socket on its own
  (as an aiohttp handler calling ``resp.write`` per chunk does), so a router in front sees
  a real stream rather than one buffer.
- ``POST /v1/audio/transcriptions`` (``multipart/form-data`` with a ``model`` field, anywhere
  in the form): ``{"text": ...}`` as vLLM answers with the default ``response_format``.
- ``POST /v1/responses``: a Responses object; with ``"stream": true`` the Responses SSE event
  sequence (``response.created``, ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, ``CHUNKS`` x ``response.output_text.delta``,
  ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
  ``response.completed`` with usage; no ``[DONE]``), each event written on its own. An
  ingress's ``request_id`` in the body becomes the response's id, as vLLM does.
- ``GET /health`` (200), ``GET /v1/models``, ``GET /version``, ``GET /metrics`` (the vLLM gauges
  the agent scrapes for load).

It is built on asyncio protocols and httptools (callbacks, no coroutine per request), so the
backend costs less per request than any router under test; its CPU is reported separately.

    python bench/fake_backend.py --port 8000 [--host 127.0.0.1] [--model bench-model]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import time
from typing import Any

import httptools
import orjson

CHUNKS = 16
MAX_BODY_BYTES = 16 * 1024 * 1024


class Backend:
    """Precomputed responses for one model name."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.counter = 0
        models = {
            "object": "list",
            "data": [{"id": model, "object": "model", "owned_by": "bench", "max_model_len": 4096}],
        }
        self.models_body = orjson.dumps(models)
        self.version_body = orjson.dumps({"version": "fake-0.1"})
        self.metrics_body = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{model}"}} 0\n'
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{model}"}} 0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="{model}"}} 0.0\n'
        ).encode()
        words = [f" tok{i}" for i in range(CHUNKS)]
        self.completion_text = "".join(words)
        self.words = words

    def next_id(self) -> str:
        self.counter += 1
        return f"chatcmpl-bench{self.counter}"

    def usage(self, prompt_bytes: int) -> dict[str, int]:
        prompt_tokens = max(1, prompt_bytes // 4)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": CHUNKS,
            "total_tokens": prompt_tokens + CHUNKS,
        }

    def completion(self, chat: bool, model: str, prompt_bytes: int) -> bytes:
        created = int(time.time())
        if chat:
            choice: dict[str, object] = {
                "index": 0,
                "message": {"role": "assistant", "content": self.completion_text},
                "finish_reason": "length",
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": self.completion_text, "finish_reason": "length"}
            obj = "text_completion"
        return orjson.dumps(
            {
                "id": self.next_id(),
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": self.usage(prompt_bytes),
            }
        )

    def transcription(self) -> bytes:
        return orjson.dumps({"text": self.completion_text.strip()})

    def response_object(
        self, rid: str, model: str, prompt_bytes: int, done: bool
    ) -> dict[str, object]:
        output: list[object] = []
        if done:
            output = [self.message_item(rid, "completed")]
        usage = self.usage(prompt_bytes)
        return {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "status": "completed" if done else "in_progress",
            "output": output,
            "usage": {
                "input_tokens": usage["prompt_tokens"],
                "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["total_tokens"],
            }
            if done
            else None,
        }

    def message_item(self, rid: str, status: str) -> dict[str, object]:
        content = [] if status != "completed" else [self.text_part(self.completion_text)]
        return {
            "id": f"msg_{rid}",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    @staticmethod
    def text_part(text: str) -> dict[str, object]:
        return {"type": "output_text", "text": text, "annotations": []}

    def response_id(self, request: dict[str, object]) -> str:
        """The ingress's ``request_id`` when it set one (vLLM makes it the id), else our own."""
        rid = request.get("request_id")
        rid = rid if isinstance(rid, str) else f"resp_bench{self.counter}"
        self.counter += 1
        return rid

    def response(self, request: dict[str, object], model: str, prompt_bytes: int) -> bytes:
        rid = self.response_id(request)
        return orjson.dumps(self.response_object(rid, model, prompt_bytes, True))

    def response_events(
        self, request: dict[str, object], model: str, prompt_bytes: int
    ) -> list[bytes]:
        """The Responses SSE sequence of one stream, each event framed as an HTTP/1.1 chunk."""
        rid = self.response_id(request)
        item_id = f"msg_{rid}"
        seq = iter(range(1 << 30))
        text = self.completion_text
        bodies: list[tuple[str, dict[str, object]]] = [
            ("response.created", {"response": self.response_object(rid, model, 0, False)}),
            ("response.in_progress", {"response": self.response_object(rid, model, 0, False)}),
            (
                "response.output_item.added",
                {"output_index": 0, "item": self.message_item(rid, "in_progress")},
            ),
            (
                "response.content_part.added",
                {
                    "item_id": item_id,
                    "output_index": 0,
                    "content_index": 0,
                    "part": self.text_part(""),
                },
            ),
            *(
                (
                    "response.output_text.delta",
                    {
                        "item_id": item_id,
                        "output_index": 0,
                        "content_index": 0,
                        "delta": word,
                        "logprobs": [],
                    },
                )
                for word in self.words
            ),
            (
                "response.output_text.done",
                {
                    "item_id": item_id,
                    "output_index": 0,
                    "content_index": 0,
                    "text": text,
                    "logprobs": [],
                },
            ),
            (
                "response.content_part.done",
                {
                    "item_id": item_id,
                    "output_index": 0,
                    "content_index": 0,
                    "part": self.text_part(text),
                },
            ),
            (
                "response.output_item.done",
                {"output_index": 0, "item": self.message_item(rid, "completed")},
            ),
            (
                "response.completed",
                {"response": self.response_object(rid, model, prompt_bytes, True)},
            ),
        ]
        events = []
        for kind, fields in bodies:
            data = orjson.dumps({"type": kind, "sequence_number": next(seq), **fields})
            events.append(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")
        return [b"%x\r\n%s\r\n" % (len(e), e) for e in events]

    def stream_events(self, chat: bool, model: str, prompt_bytes: int) -> list[bytes]:
        """Every SSE event of one stream, each already framed as an HTTP/1.1 chunk."""
        rid = self.next_id()
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        events = []
        for i, word in enumerate(self.words):
            if chat:
                delta: dict[str, str] = {"content": word}
                if i == 0:
                    delta["role"] = "assistant"
                choice: dict[str, object] = {"index": 0, "delta": delta, "finish_reason": None}
            else:
                choice = {"index": 0, "text": word, "finish_reason": None}
            if i == CHUNKS - 1:
                choice["finish_reason"] = "length"
            payload = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
            }
            events.append(b"data: " + orjson.dumps(payload) + b"\n\n")
        usage = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [],
            "usage": self.usage(prompt_bytes),
        }
        events.append(b"data: " + orjson.dumps(usage) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return [b"%x\r\n%s\r\n" % (len(e), e) for e in events]


def _response(status: bytes, content_type: bytes, body: bytes, keep_alive: bool) -> bytes:
    return b"".join(
        (
            b"HTTP/1.1 ",
            status,
            b"\r\ncontent-type: ",
            content_type,
            b"\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\n" if keep_alive else b"\r\nconnection: close\r\n",
            b"\r\n",
            body,
        )
    )


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n"
)
JSON = b"application/json"


class Connection(asyncio.Protocol):
    """One client connection; requests are answered in order as they complete."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.body_len = 0

    # -- asyncio -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._close()
        except httptools.HttpParserError:
            self._write(_response(b"400 Bad Request", JSON, b'{"error":"bad request"}', False))
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    # -- httptools -----------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []
        self.body_len = 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body_len += len(body)
        if self.body_len > MAX_BODY_BYTES:
            self._write(_response(b"413 Payload Too Large", JSON, b'{"error":"too large"}', False))
            self._close()
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        keep_alive = self.parser.should_keep_alive()  # only valid inside this callback
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            self._complete(path == b"/v1/chat/completions", keep_alive)
        elif method == b"POST" and path == b"/v1/responses":
            self._respond(keep_alive)
        elif method == b"POST" and path == b"/v1/audio/transcriptions":
            self._transcribe(keep_alive)
        elif method == b"GET" and path == b"/health":
            self._write(_response(b"200 OK", JSON, b"{}", keep_alive))
        elif method == b"GET" and path == b"/v1/models":
            self._write(_response(b"200 OK", JSON, self.backend.models_body, keep_alive))
        elif method == b"GET" and path == b"/version":
            self._write(_response(b"200 OK", JSON, self.backend.version_body, keep_alive))
        elif method == b"GET" and path == b"/metrics":
            body = self.backend.metrics_body
            self._write(_response(b"200 OK", b"text/plain; version=0.0.4", body, keep_alive))
        else:
            self._write(_response(b"404 Not Found", JSON, b'{"error":"not found"}', keep_alive))
        if not keep_alive:
            self._close()

    # -- helpers -------------------------------------------------------------------------------
    def _json_request(self, keep_alive: bool) -> tuple[dict[str, Any], str, bool, int] | None:
        """The body's request, its model (the backend's when it names none), whether it asks
        for a stream and its size; None, with a 400 sent, when it is not a JSON object."""
        raw = b"".join(self.body)
        try:
            request = orjson.loads(raw)
            model = request.get("model") or self.backend.model
            stream = bool(request.get("stream"))
        except (orjson.JSONDecodeError, AttributeError):
            self._write(_response(b"400 Bad Request", JSON, b'{"error":"bad json"}', keep_alive))
            return None
        if not isinstance(model, str):
            model = self.backend.model
        return request, model, stream, len(raw)

    def _complete(self, chat: bool, keep_alive: bool) -> None:
        parsed = self._json_request(keep_alive)
        if parsed is None:
            return
        _, model, stream, size = parsed
        if not stream:
            body = self.backend.completion(chat, model, size)
            self._write(_response(b"200 OK", JSON, body, keep_alive))
            return
        self._stream(self.backend.stream_events(chat, model, size), keep_alive)

    def _respond(self, keep_alive: bool) -> None:
        parsed = self._json_request(keep_alive)
        if parsed is None:
            return
        request, model, stream, size = parsed
        if not stream:
            body = self.backend.response(request, model, size)
            self._write(_response(b"200 OK", JSON, body, keep_alive))
            return
        self._stream(self.backend.response_events(request, model, size), keep_alive)

    def _transcribe(self, keep_alive: bool) -> None:
        # no form parsing: the fake checks only that a model field came (the router's concern)
        if b'name="model"' not in b"".join(self.body):
            body = b'{"error":"the form has no model field"}'
            self._write(_response(b"400 Bad Request", JSON, body, keep_alive))
            return
        self._write(_response(b"200 OK", JSON, self.backend.transcription(), keep_alive))

    def _stream(self, events: list[bytes], keep_alive: bool) -> None:
        head = STREAM_HEAD if keep_alive else STREAM_HEAD + b"connection: close\r\n"
        # Each write goes to the socket at once when its buffer is empty: one send per event.
        self._write(head + b"\r\n" + events[0])
        for event in events[1:]:
            self._write(event)
        self._write(b"0\r\n\r\n")

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


async def serve(host: str, port: int, model: str) -> None:
    loop = asyncio.get_running_loop()
    backend = Backend(model)
    server = await loop.create_server(
        lambda: Connection(backend), host, port, reuse_address=True, backlog=1024
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sock = server.sockets[0].getsockname()
    print(f"fake-backend: http http://{sock[0]}:{sock[1]} model {model}", flush=True)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=os.environ.get("FAKE_BACKEND_MODEL", "bench-model"))
    args = parser.parse_args()
    logging.getLogger("asyncio").setLevel(logging.ERROR)  # no noise for clients that hang up
    gc.freeze()  # long-lived objects out of the collector's way; requests allocate little
    asyncio.run(serve(args.host, args.port, args.model))


if __name__ == "__main__":
    main()
