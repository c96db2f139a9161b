"""The router benchmark's second fake backend: the same answers as ``fake_backend.py``, served by
aiohttp handlers: the setup the data plane's first targets were measured under
(direct-to-backend ≈ 0.9 ms mean at c=1; docs/benchmarks.md).

``fake_backend.py`` answers in ≈ 0.03 ms, so in front of it a router's own CPU is the whole
story; this one costs what a typical Python web stack costs per request, the condition the
data-plane targets were set under. The payloads come from ``fake_backend.Backend`` (identical
bytes); each SSE event is one ``resp.write``.

Needs aiohttp, orjson and httptools: ``bench/router.py --backend aiohttp`` runs it from the
``aiohttp-backend`` venv that ``bench/_venvs.py`` installs from PyPI.

    python bench/aiohttp_backend.py --port 8000 [--host 127.0.0.1] [--model bench-model]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path

import orjson
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_backend import Backend

JSON = "application/json"


def make_app(backend: Backend) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        chat = request.path == "/v1/chat/completions"
        try:
            doc = orjson.loads(raw)
            model = doc.get("model") or backend.model
            stream = bool(doc.get("stream"))
        except (orjson.JSONDecodeError, AttributeError):
            return web.Response(status=400, body=b'{"error":"bad json"}', content_type=JSON)
        if not isinstance(model, str):
            model = backend.model
        if not stream:
            body = backend.completion(chat, model, len(raw))
            return web.Response(body=body, content_type=JSON)
        resp = web.StreamResponse(
            headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for event in backend.stream_events(chat, model, len(raw)):
            # stream_events frames chunks for a raw socket; aiohttp frames them itself.
            payload = event.split(b"\r\n", 1)[1][:-2]
            await resp.write(payload)
        await resp.write_eof()
        return resp

    async def health(_request: web.Request) -> web.Response:
        return web.Response(body=b"{}", content_type=JSON)

    async def models(_request: web.Request) -> web.Response:
        return web.Response(body=backend.models_body, content_type=JSON)

    async def version(_request: web.Request) -> web.Response:
        return web.Response(body=backend.version_body, content_type=JSON)

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=backend.metrics_body, content_type="text/plain")

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=os.environ.get("FAKE_BACKEND_MODEL", "bench-model"))
    args = parser.parse_args()
    logging.getLogger("aiohttp.access").setLevel(logging.ERROR)
    gc.freeze()
    print(f"aiohttp-backend: http http://{args.host}:{args.port} model {args.model}", flush=True)
    web.run_app(
        make_app(Backend(args.model)),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        backlog=1024,
    )


if __name__ == "__main__":
    main()
