"""Closed-loop HTTP load generator for bench/router.py, run in a process of its own.

Reads one JSON cell spec per line on stdin, runs it, writes one JSON result per line on stdout.
Each of ``concurrency`` keep-alive connections sends a request, waits for the whole response,
and sends the next at once. The client is asyncio protocols plus httptools' response parser:
no coroutine, task or buffer copy per request, so its own CPU stays small next to the router's.

A cell: ``warmup_s`` of load that is not recorded, then ``seconds`` of recorded load (requests
that complete inside the window), framed by readings of /proc/PID/stat for the process groups
named in ``cpu_groups`` (so CPU and requests cover exactly the same window), then a drain.

Spec keys: host, port, path, model, stream, concurrency, warmup_s, seconds, prompt_bytes,
headers (dict), cpu_groups (name -> [pid]), drain_s, client ("protocol", the default, or
"aiohttp": closed-loop aiohttp.ClientSession clients, run from the aiohttp-backend venv), and
optionally api (``API_CHAT``, the default: a chat completion, streamed with ``stream``;
``API_AUDIO``: a ``multipart/form-data`` transcription upload of a WAV file of about
``audio_bytes``, the ``model`` field after the file part; ``API_RESPONSES``: a Responses
request, streamed with ``stream``). A chat spec builds the same bytes as before ``api`` existed.
Result keys: completed, errors, connections (opened), error_samples, window_s, latencies_us,
ttft_us, cpu_ticks (name -> ticks), client_ticks, host_busy_ticks and host_total_ticks (all
CPUs, /proc/stat), clk_tck.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import io
import json
import os
import socket
import sys
import time
import wave
from typing import Any

import httptools
import orjson
from _procs import cpu_ticks, host_ticks

PROMPT_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "routers", "count"]


def prompt_text(size: int) -> str:
    words: list[str] = []
    length = 0
    i = 0
    while length < size:
        word = PROMPT_WORDS[i % len(PROMPT_WORDS)]
        words.append(word)
        length += len(word) + 1
        i += 1
    return " ".join(words)[:size]


API_CHAT = "chat"
API_AUDIO = "audio"
API_RESPONSES = "responses"
FORM_BOUNDARY = "----fabricbench7d1f0c2a9b"


@functools.cache
def wav_file(size: int) -> bytes:
    """A mono 16 kHz 16-bit WAV of about ``size`` bytes (a quiet sawtooth), made once."""
    frames = max(1, (size - 44) // 2)
    samples = b"".join(
        ((i * 37) % 2048 - 1024).to_bytes(2, "little", signed=True) for i in range(frames)
    )
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(samples)
    return out.getvalue()


def request_body(spec: dict[str, Any]) -> tuple[str, bytes]:
    """The content type and body of the cell's request."""
    api = spec.get("api", API_CHAT)
    if api == API_AUDIO:
        b = FORM_BOUNDARY.encode()
        body = b"".join(
            (
                b"--" + b + b"\r\n",
                b'Content-Disposition: form-data; name="file"; filename="bench.wav"\r\n',
                b"Content-Type: audio/wav\r\n\r\n",
                wav_file(int(spec.get("audio_bytes", 65536))),
                b"\r\n--" + b + b"\r\n",
                b'Content-Disposition: form-data; name="model"\r\n\r\n',
                str(spec["model"]).encode(),
                b"\r\n--" + b + b"--\r\n",
            )
        )
        return f"multipart/form-data; boundary={FORM_BOUNDARY}", body
    payload: dict[str, Any]
    if api == API_RESPONSES:
        payload = {
            "model": spec["model"],
            "input": prompt_text(int(spec["prompt_bytes"])),
            "max_output_tokens": 16,
            "stream": bool(spec["stream"]),
        }
        return "application/json", orjson.dumps(payload)
    payload = {
        "model": spec["model"],
        "messages": [{"role": "user", "content": prompt_text(int(spec["prompt_bytes"]))}],
        "max_tokens": 16,
        "stream": bool(spec["stream"]),
    }
    if spec["stream"]:
        payload["stream_options"] = {"include_usage": True}
    return "application/json", orjson.dumps(payload)


def done_marker(spec: dict[str, Any]) -> bytes | None:
    """What the last bytes of a complete stream hold; None for a JSON response."""
    if not spec["stream"]:
        return None
    return b"response.completed" if spec.get("api") == API_RESPONSES else b"[DONE]"


def build_request(spec: dict[str, Any]) -> bytes:
    content_type, body = request_body(spec)
    lines = [
        f"POST {spec['path']} HTTP/1.1",
        f"Host: {spec['host']}:{spec['port']}",
        f"Content-Type: {content_type}",
        "Accept: */*",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in spec.get("headers", {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Run:
    """One cell: its connections, its counters and its recorded samples."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.host = spec["host"]
        self.port = int(spec["port"])
        self.stream = bool(spec["stream"])
        self.content_type, _ = request_body(spec)
        self.request = build_request(spec)
        self.marker = done_marker(spec)
        # the Responses stream ends with a response.completed event of several hundred bytes
        self.tail_bytes = 256 if spec.get("api", API_CHAT) == API_CHAT else 4096
        self.running = True
        self.measuring = False
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.errors = 0
        self.error_samples: list[str] = []
        self.open: set[Client] = set()
        self.connections = 0
        self.all_closed = asyncio.Event()

    def error(self, what: str) -> None:
        if self.measuring:
            self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what[:300])

    def record(self, client: Client, now: float) -> None:
        status = client.parser.get_status_code()
        if status != 200:
            self.error(f"HTTP {status}: {client.tail[-200:]!r}")
            return
        if self.marker is not None and self.marker not in client.tail:
            self.error(f"stream without {self.marker.decode()}: {client.tail[-200:]!r}")
            return
        if self.measuring:
            self.latencies.append(now - client.t_start)
            self.ttfts.append(client.t_first - client.t_start)

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        while self.running:
            try:
                await loop.create_connection(lambda: Client(self), self.host, self.port)
                self.connections += 1
                return
            except OSError as exc:
                self.error(f"connect: {exc}")
                await asyncio.sleep(0.05)

    def closed(self, client: Client) -> None:
        self.open.discard(client)
        if self.running:
            asyncio.get_running_loop().create_task(self.connect())
        elif not self.open:
            self.all_closed.set()


class Client(asyncio.Protocol):
    def __init__(self, run: Run) -> None:
        self.run = run
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.t_start = 0.0
        self.t_first = 0.0
        self.tail = b""
        self.inflight = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.run.open.add(self)
        self.send()

    def send(self) -> None:
        assert self.transport is not None
        if not self.run.running:
            self.transport.close()
            return
        self.tail = b""
        self.t_first = 0.0
        self.inflight = True
        self.t_start = time.perf_counter()
        self.transport.write(self.run.request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.run.error(f"parse error: {exc}")
            self.inflight = False
            if self.transport is not None:
                self.transport.abort()

    def on_body(self, body: bytes) -> None:
        if not self.t_first:
            self.t_first = time.perf_counter()
        n = self.run.tail_bytes
        self.tail = body[-n:] if len(body) >= n else (self.tail + body)[-n:]

    def on_message_complete(self) -> None:
        now = time.perf_counter()
        self.inflight = False
        keep_alive = self.parser.should_keep_alive()  # only valid inside this callback
        if not self.t_first:
            self.t_first = now
        self.run.record(self, now)
        if keep_alive:
            self.send()
        elif self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inflight:
            self.run.error(f"connection lost mid-request: {exc}")
        self.transport = None
        self.run.closed(self)


async def aiohttp_client(run: Run) -> None:
    """One closed-loop client on aiohttp's keep-alive pool: a typical Python client's cost per
    request (the notes' setup), where the protocol client above is nearly free."""
    import aiohttp  # only in the aiohttp-backend venv (bench/_venvs.py)

    spec = run.spec
    url = f"http://{run.host}:{run.port}{spec['path']}"
    body = run.request.split(b"\r\n\r\n", 1)[1]
    headers = {"content-type": run.content_type, **spec.get("headers", {})}
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        run.connections += 1
        while run.running:
            t_start = time.perf_counter()
            t_first = 0.0
            tail = b""
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    async for piece in resp.content.iter_any():
                        if not t_first:
                            t_first = time.perf_counter()
                        tail = (tail + piece)[-run.tail_bytes :]
                    status = resp.status
            except (aiohttp.ClientError, OSError) as exc:
                run.error(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.01)
                continue
            now = time.perf_counter()
            if status != 200:
                run.error(f"HTTP {status}: {tail[-200:]!r}")
            elif run.marker is not None and run.marker not in tail:
                run.error(f"stream without {run.marker.decode()}: {tail[-200:]!r}")
            elif run.measuring:
                run.latencies.append(now - t_start)
                run.ttfts.append((t_first or now) - t_start)


async def run_cell(spec: dict[str, Any]) -> dict[str, Any]:
    run = Run(spec)
    groups: dict[str, list[int]] = spec.get("cpu_groups", {})
    tasks = []
    for _ in range(int(spec["concurrency"])):
        if spec.get("client") == "aiohttp":
            tasks.append(asyncio.get_running_loop().create_task(aiohttp_client(run)))
        else:
            asyncio.get_running_loop().create_task(run.connect())
    await asyncio.sleep(float(spec["warmup_s"]))
    before = {name: cpu_ticks(pids) for name, pids in groups.items()}
    client_before = cpu_ticks([os.getpid()])
    host_before = host_ticks()
    t0 = time.perf_counter()
    run.measuring = True
    await asyncio.sleep(float(spec["seconds"]))
    run.measuring = False
    t1 = time.perf_counter()
    after = {name: cpu_ticks(pids) for name, pids in groups.items()}
    client_after = cpu_ticks([os.getpid()])
    host_after = host_ticks()
    run.running = False
    if tasks:
        await asyncio.wait(tasks, timeout=float(spec.get("drain_s", 2.0)))
        for task in tasks:
            task.cancel()
    if run.open:
        try:
            await asyncio.wait_for(run.all_closed.wait(), float(spec.get("drain_s", 2.0)))
        except TimeoutError:
            pass
    for client in list(run.open):
        if client.transport is not None:
            client.transport.abort()
    await asyncio.sleep(0)
    return {
        "completed": len(run.latencies),
        "errors": run.errors,
        "connections": run.connections,  # > concurrency: the target closed connections
        "error_samples": run.error_samples,
        "window_s": t1 - t0,
        "latencies_us": [round(x * 1e6) for x in run.latencies],
        "ttft_us": [round(x * 1e6) for x in run.ttfts],
        "cpu_ticks": {name: after[name] - before[name] for name in groups},
        "client_ticks": client_after - client_before,
        "host_busy_ticks": host_after[0] - host_before[0],
        "host_total_ticks": host_after[1] - host_before[1],
        "clk_tck": os.sysconf("SC_CLK_TCK"),
    }


def main() -> None:
    gc.freeze()
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        gc.collect()
        gc.disable()  # no collector pauses inside a measured window
        try:
            result = asyncio.run(run_cell(spec))
        except Exception as exc:  # report, do not die: the next cell may work
            result = {"fatal": f"{type(exc).__name__}: {exc}"}
        finally:
            gc.enable()
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
