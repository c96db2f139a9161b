"""The simulated engine's shell: a raw ASGI app with vLLM's OpenAI-compatible surface, served by
hypercorn's trio worker, over the trio driver of the pure ``Scheduler`` (``driver``).

Endpoints:

* ``GET /health`` — 200 with an empty body (as vLLM), unless hung; ``GET``/``POST /ping`` the
  same.
* ``GET /version`` — ``{"version": ...}``.
* ``GET /v1/models`` — the model with ``max_model_len``, then its LoRA adapters (``lora``).
* ``POST /v1/chat/completions``, ``POST /v1/completions`` — non-stream JSON with ``usage``, or with
  ``"stream": true`` server-sent events, one chunk per token as the scheduler produces it, ending
  ``data: [DONE]`` (``stream_options.include_usage`` adds a usage chunk). These and
  ``/v1/responses`` read vLLM's ``priority`` field (an integer, lower first): honoured with
  ``--scheduling-policy priority``, else a non-zero one is a 400, as vLLM answers.
* ``POST /v1/embeddings`` — deterministic unit vectors.
* Routed here, served by their modules: ``/v1/responses`` (``responses``), ``/v1/messages``
  (``messages``; errors there in Anthropic's shape), ``/rerank``, ``/score``, ``/pooling``,
  ``/classify``, ``/tokenize``, ``/detokenize`` (``pooling``), ``/v1/audio/transcriptions`` and
  ``translations`` (``audio``, multipart), ``/v1/load_lora_adapter`` and
  ``/v1/unload_lora_adapter`` with ``--enable-lora`` (``lora``). The ones that run the model
  (all but count_tokens, tokenize, detokenize and the adapter endpoints) are inference
  requests like chat: refused while asleep, counted, subject to the error rate, aborted when
  their client leaves.
* ``GET /metrics`` — Prometheus text with vLLM's names (``vllm:num_requests_waiting``, which
  counts preempted requests waiting to resume, ``vllm:num_preemptions_total``,
  ``vllm:engine_sleep_state`` ...), each labelled ``model_name``; and one of its own,
  ``fabric_simengine_requests_by_priority_total{priority}`` (requests by their priority field).
* Sleep mode, vLLM's development endpoints: ``POST /sleep?level=0|1|2`` (default 1) cuts the
  requests in flight short (vLLM's default ``abort`` mode), frees the KV cache (the prefix
  cache is forgotten) and answers ``{"status": "sleeping", "level": N}``; ``POST /wake_up``
  takes ``wake_up_s`` (the weights coming back) and answers ``{"status": "awake", ...}``;
  ``GET /is_sleeping`` answers ``{"is_sleeping": bool}``. While asleep (and waking) the
  inference endpoints answer 503 ``model_sleeping`` and the metrics show an idle engine;
  ``/health``, ``/v1/models`` and ``/metrics`` answer as usual. (vLLM 0.32 queues such requests
  until the wake-up instead; older vLLM answered 503, which is what an ingress can act on.)

Errors have the OpenAI shape: 400 bad JSON or fields, 404 unknown path or model, 405 wrong method,
500 injected errors, 503 asleep. Fault injection (``FaultConfig``): exit after N inference
requests or T seconds (``os._exit``, no cleanup, like a crashed engine), hang after T seconds
(nothing answers any more, ``/health`` included; in-flight requests stall), a slow-down factor,
an error rate.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qs

import trio
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fabricnode.asgi import Receive, Send, header, lifespan, serve_http
from fabricnode.metricfamilies import CONTENT_TYPE as METRICS_CONTENT_TYPE
from fabricnode.metricfamilies import counter, gauge, registry_of
from fabricnode.simengine.audio import DEFAULT_MAX_UPLOAD_BYTES, AudioAPI
from fabricnode.simengine.driver import EngineDriver, StepLog
from fabricnode.simengine.generation import (
    DEFAULT_MAX_TOKENS,
    GENERATION_PROMPT,
    Generator,
    render_chat,
    request_priority,
)
from fabricnode.simengine.httpio import (
    ClientGone,
    HttpError,
    Json,
    Scope,
    anthropic_error_doc,
    error_doc,
    parse_json,
    read_body,
)
from fabricnode.simengine.httpio import dumps as _dumps
from fabricnode.simengine.httpio import send_body as _send_body
from fabricnode.simengine.httpio import send_json as _send_json
from fabricnode.simengine.kvpublish import KvEventsConfig, KvPublisher
from fabricnode.simengine.lora import Models, Served
from fabricnode.simengine.messages import MessagesAPI
from fabricnode.simengine.model import (
    EngineConfig,
    detokenize,
    embedding,
    tokenize,
)
from fabricnode.simengine.pooling import PoolingAPI
from fabricnode.simengine.responses import (
    DEFAULT_STORE_MAX_BYTES,
    DEFAULT_STORE_MAX_RESPONSES,
    ResponsesAPI,
    ResponseStore,
)

__all__ = [
    "ClientGone",
    "EngineDriver",
    "FaultConfig",
    "HttpError",
    "SimConfig",
    "SimEngineApp",
    "error_doc",
    "serve",
]

log = logging.getLogger("fabricnode.simengine")

VERSION = "fabricnode-sim/0.1.0"
CRASH_EXIT_CODE = 3
# Wake-up from sleep level 1: the weights come back from host memory, seconds for a large
# model (a cold start loads them from disk and compiles: minutes).
DEFAULT_WAKE_UP_S = 3.0
SLEEP_LEVELS = (0, 1, 2)
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # vllm:engine_sleep_state


@dataclass(frozen=True)
class FaultConfig:
    crash_after_requests: int | None = None
    crash_after_s: float | None = None
    hang_after_s: float | None = None
    slowdown: float = 1.0
    error_rate: float = 0.0


@dataclass(frozen=True)
class SimConfig:
    engine: EngineConfig
    faults: FaultConfig = field(default_factory=FaultConfig)
    embedding_dims: int = 64
    max_body_bytes: int = 16 * 1024 * 1024
    shutdown_grace_s: float = 5.0
    wake_up_s: float = DEFAULT_WAKE_UP_S
    enable_lora: bool = False  # vLLM's --enable-lora: adapters, load/unload endpoints
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) loaded at start
    responses_store_max: int = DEFAULT_STORE_MAX_RESPONSES
    responses_store_max_bytes: int = DEFAULT_STORE_MAX_BYTES
    max_audio_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    step_log: str | None = None  # a JSON line per step appended here (``StepLog``)
    kv_events: KvEventsConfig | None = None  # ``--kv-events-config`` (``kvpublish``)
    # vLLM's --enable-prompt-tokens-details: usage says the prompt tokens found cached
    prompt_tokens_details: bool = False


@dataclass(frozen=True)
class EngineStatistics:
    requests_total: int
    errors_injected: int
    hung: bool
    sleep_level: int | None  # None: awake
    sleeps: int
    wake_ups: int


# -- the app ----------------------------------------------------------------------------------


class EngineMetrics(Collector):
    """vLLM's metric families, each labelled ``model_name``, read from the scheduler at each
    scrape."""

    def __init__(self, app: SimEngineApp) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        s = self.app.driver.scheduler.statistics()
        labels = {"model_name": self.app.model}
        yield gauge("vllm:num_requests_running", "Requests in the running batch", s.running, labels)
        yield gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled", s.waiting, labels
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage (1 means 100 percent)",
            s.kv_cache_usage,
            labels,
        )
        yield counter(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in tokens",
            s.prefix_cache_queries,
            labels,
        )
        yield counter(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in tokens",
            s.prefix_cache_hits,
            labels,
        )
        yield counter(
            "vllm:prompt_tokens_total", "Prefill tokens processed", s.prompt_tokens, labels
        )
        yield counter(
            "vllm:generation_tokens_total",
            "Generation tokens processed",
            s.generation_tokens,
            labels,
        )
        yield counter(
            "vllm:request_success_total", "Finished requests", s.requests_finished, labels
        )
        yield counter(
            "vllm:num_preemptions_total",
            "Cumulative number of preemptions from the engine",
            s.num_preemptions,
            labels,
        )
        if s.requests_by_priority:  # not vLLM's: what the priority field of requests said
            by_priority = CounterMetricFamily(
                "fabric_simengine_requests_by_priority",
                "Requests submitted to the scheduler, by their priority field (0 when absent)",
                labels=["model_name", "priority"],
            )
            for priority, count in s.requests_by_priority:
                by_priority.add_metric([self.app.model, str(priority)], count)
            yield by_priority
        level = self.app.sleep_level
        current = SLEEP_STATES[0] if not level else SLEEP_STATES[level]
        family = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state (awake 1: awake; weights_offloaded 1: level 1; discard_all 1: "
            "level 2)",
            labels=["model_name", "sleep_state"],
        )
        for state in SLEEP_STATES:
            family.add_metric([self.app.model, state], 1.0 if state == current else 0.0)
        yield family


class SimEngineApp:
    """ASGI callable over one ``EngineDriver``."""

    def __init__(
        self,
        config: SimConfig,
        driver: EngineDriver,
        *,
        crash: Callable[[str], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.model = config.engine.model
        self.driver = driver
        self.crash = crash or _crash
        self.wall_clock = wall_clock
        self.rng = random.Random(config.engine.seed)
        self.requests = 0
        self.inference_requests = 0
        self.errors_injected = 0
        self._ids = 0
        self.sleep_level: int | None = None  # None: awake; else the level it sleeps at
        self.sleeps = 0
        self.wake_ups = 0
        self._sleep_lock = trio.Lock()  # one sleep or wake-up at a time, in arrival order
        self.metrics_registry = registry_of(EngineMetrics(self))
        cfg = config.engine
        self.models = Models(
            self.model,
            cfg.max_model_len,
            enable_lora=config.enable_lora,
            lora_modules=config.lora_modules,
        )
        self.generator = Generator(driver, cfg.max_model_len, DEFAULT_MAX_TOKENS)
        self.responses = ResponsesAPI(
            self.models,
            self.generator,
            ResponseStore(config.responses_store_max, config.responses_store_max_bytes),
            wall_clock,
        )
        self.messages = MessagesAPI(self.models, self.generator)
        self.pooling = PoolingAPI(
            self.models,
            self.generator,
            seed=cfg.seed,
            embedding_dims=config.embedding_dims,
            wall_clock=wall_clock,
        )
        self.audio = AudioAPI(
            self.models,
            self.generator,
            wall_clock=wall_clock,
            max_upload_bytes=config.max_audio_bytes,
        )

    async def run_background(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Host the work that outlives a request (background responses) until cancelled."""
        async with trio.open_nursery() as nursery:
            self.responses.nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            self.inference_requests,
            self.errors_injected,
            self.driver.hung,
            self.sleep_level,
            self.sleeps,
            self.wake_ups,
        )

    # -- sleep mode --

    async def sleep(self, level: int) -> Json:
        async with self._sleep_lock:
            if self.sleep_level is None:
                self.sleeps += 1
                self.driver.free_kv()
            # asleep already: a deeper level discards more, a lighter one keeps what is gone
            self.sleep_level = max(level, self.sleep_level or 0)
            log.info("asleep at level %d", self.sleep_level)
        return {"status": "sleeping", "level": level}

    async def wake_up(self) -> Json:
        async with self._sleep_lock:
            if self.sleep_level is not None:
                await trio.sleep(self.config.wake_up_s)  # the weights coming back
                self.sleep_level = None
                self.wake_ups += 1
                log.info("awake after %g s", self.config.wake_up_s)
        return {"status": "awake", "tags": None}

    def _sleep_request(
        self, method: str, path: str, query: bytes
    ) -> Callable[[], Awaitable[Json]] | None:
        """The handler of a sleep-mode endpoint (None: not one); HttpError when misused."""
        if path == "/is_sleeping":
            if method not in ("GET", "HEAD"):
                raise HttpError(405, f"method {method} not allowed; use GET", "method_not_allowed")
            return lambda: _async_value({"is_sleeping": self.sleep_level is not None})
        if path not in ("/sleep", "/wake_up"):
            return None
        if method != "POST":
            raise HttpError(405, f"method {method} not allowed; use POST", "method_not_allowed")
        if path == "/wake_up":
            return self.wake_up
        params = parse_qs(query.decode("latin-1"))
        text = params.get("level", ["1"])[-1]
        if not text.isdigit() or int(text) not in SLEEP_LEVELS:
            raise HttpError(400, f"level must be 0, 1 or 2, got {text!r}", "invalid_parameter")
        level = int(text)
        return lambda: self.sleep(level)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if self.driver.hung:
            await trio.sleep_forever()
        self.requests += 1
        method, path = scope["method"], scope["path"]
        try:
            handler = self._sleep_request(method, path, scope.get("query_string", b""))
            if handler is not None:
                await _send_json(send, await handler())
                return
            await self._dispatch(method, path, scope, receive, send)
        except ClientGone:
            return
        except HttpError as exc:
            if path.startswith("/v1/messages"):
                doc = anthropic_error_doc(exc)  # what vLLM answers on the Anthropic paths
            else:
                doc = error_doc(exc.status, exc.message, exc.code, exc.param, exc.kind)
            await _send_json(send, doc, exc.status)
        limit = self.config.faults.crash_after_requests
        if limit is not None and self.inference_requests >= limit:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.05)  # let the last answer leave
            self.crash(f"crashing after {self.inference_requests} requests (fault injection)")

    def _json_posts(self) -> dict[str, tuple[Callable[[Json, Send], Awaitable[None]], bool]]:
        """POST endpoints with a JSON body: path -> (handler, runs on the engine)."""
        pooling = self.pooling
        posts: dict[str, tuple[Callable[[Json, Send], Awaitable[None]], bool]] = {
            "/v1/chat/completions": (self.chat, True),
            "/v1/completions": (self.completions, True),
            "/v1/embeddings": (self.embeddings, True),
            "/v1/responses": (self.responses.create, True),
            "/v1/messages": (self.messages.create, True),
            "/v1/messages/count_tokens": (self.messages.count_tokens, False),
            "/rerank": (pooling.rerank, True),
            "/v1/rerank": (pooling.rerank, True),
            "/v2/rerank": (pooling.rerank, True),
            "/score": (pooling.score, True),
            "/v1/score": (pooling.score, True),
            "/pooling": (pooling.pooling, True),
            "/classify": (pooling.classify, True),
            "/tokenize": (pooling.tokenize, False),
            "/detokenize": (pooling.detokenize, False),
        }
        if self.models.enable_lora:
            posts["/v1/load_lora_adapter"] = (self._load_lora, False)
            posts["/v1/unload_lora_adapter"] = (self._unload_lora, False)
        return posts

    async def _load_lora(self, request: Json, send: Send) -> None:
        await _send_body(send, 200, self.models.load(request).encode(), "text/plain")

    async def _unload_lora(self, request: Json, send: Send) -> None:
        await _send_body(send, 200, self.models.unload(request).encode(), "text/plain")

    async def _dispatch(
        self, method: str, path: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        gets: dict[str, Callable[[], tuple[int, bytes, str]]] = {
            "/health": lambda: (200, b"", "text/plain"),
            "/ping": lambda: (200, b"", "text/plain"),
            "/version": lambda: (200, _dumps({"version": VERSION}), "application/json"),
            "/v1/models": lambda: (200, _dumps(self.models_doc()), "application/json"),
            "/metrics": lambda: (200, generate_latest(self.metrics_registry), METRICS_CONTENT_TYPE),
        }
        if path == "/ping" and method == "POST":  # vLLM (SageMaker's) answers both
            await _send_body(send, 200, b"", "text/plain")
            return
        if path in gets:
            if method not in ("GET", "HEAD"):
                raise HttpError(405, f"method {method} not allowed; use GET", "method_not_allowed")
            status, body, ctype = gets[path]()
            await _send_body(send, status, b"" if method == "HEAD" else body, ctype)
            return
        if path.startswith("/v1/responses/"):
            await self._stored_response(method, path[len("/v1/responses/") :], send)
            return
        forms = {
            "/v1/audio/transcriptions": self.audio.transcriptions,
            "/v1/audio/translations": self.audio.translations,
        }
        posts = self._json_posts()
        if path not in posts and path not in forms:
            raise HttpError(404, f"no such endpoint: {path}", "not_found")
        if method != "POST":
            raise HttpError(405, f"method {method} not allowed; use POST", "method_not_allowed")
        if path in forms:
            try:
                body = await read_body(receive, self.audio.body_limit, "upload")
            except HttpError as exc:
                if exc.code != "body_too_large":
                    raise
                raise HttpError(
                    400, "Maximum file size exceeded", 400, "audio_filesize_mb"
                ) from None
            content_type = header(scope, b"content-type")
            form_handler = forms[path]

            async def run(guarded: Send) -> None:
                await form_handler(body, content_type, guarded)

            await self._inference(run, receive, send)
            return
        request = parse_json(await read_body(receive, self.config.max_body_bytes))
        handler, on_engine = posts[path]

        async def run_json(guarded: Send) -> None:
            await handler(request, guarded)

        if not on_engine:
            await handler(request, send)
            return
        await self._inference(run_json, receive, send)

    async def _stored_response(self, method: str, rest: str, send: Send) -> None:
        """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``."""
        response_id, _, action = rest.partition("/")
        if not response_id or action not in ("", "cancel"):
            raise HttpError(404, f"no such endpoint: /v1/responses/{rest}", "not_found")
        want = "POST" if action == "cancel" else "GET"
        if method != want and not (want == "GET" and method == "HEAD"):
            raise HttpError(405, f"method {method} not allowed; use {want}", "method_not_allowed")
        if action == "cancel":
            await self.responses.cancel(response_id, send)
        else:
            await self.responses.retrieve(response_id, send)

    async def _inference(
        self, run: Callable[[Send], Awaitable[None]], receive: Receive, send: Send
    ) -> None:
        """Run an endpoint that uses the engine: refused while asleep, counted (for the crash
        fault), maybe failed (error rate), and aborted when its client goes away."""
        if self.sleep_level is not None:
            raise HttpError(
                503, "the model is sleeping: wake it with POST /wake_up", "model_sleeping"
            )
        self.inference_requests += 1
        if self.rng.random() < self.config.faults.error_rate:
            self.errors_injected += 1
            raise HttpError(500, "simulated engine error (fault injection)", "internal_error")
        # A client that goes away aborts its request, freeing its batch slot and KV tokens.
        # The last body message is never cancelled: hypercorn reports the disconnect that ends
        # every exchange from inside that very send, and interrupting it wedges the connection.
        error: HttpError | None = None
        finishing = False

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal finishing
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finishing = True
            await send(message)

        async def cancel_on_disconnect(scope: trio.CancelScope) -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not finishing:
                        scope.cancel()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_disconnect, nursery.cancel_scope)
            try:
                await run(guarded_send)
            except HttpError as exc:
                error = exc  # raised outside the nursery, so not wrapped in an ExceptionGroup
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error

    # -- documents --

    def models_doc(self) -> Json:
        return {"object": "list", "data": self.models.cards(int(self.wall_clock()))}

    # -- inference --

    def _next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-sim{self._ids:08d}"

    def _check_model(self, request: Json) -> Served:
        """The model (or LoRA adapter) a request names; vLLM serves its one model when none is
        named."""
        return self.models.resolve(request.get("model"))

    def _max_tokens(self, request: Json, prompt_len: int) -> int:
        value = request.get("max_completion_tokens", request.get("max_tokens"))
        return self.generator.max_tokens(value, prompt_len)

    def _stream_flags(self, request: Json) -> tuple[bool, bool]:
        stream = request.get("stream", False)
        if not isinstance(stream, bool):
            raise HttpError(400, "'stream' must be a boolean", "invalid_parameter", "stream")
        options = request.get("stream_options") or {}
        if not isinstance(options, dict):
            raise HttpError(400, "'stream_options' must be an object", "invalid_parameter")
        n = request.get("n", 1)
        if n != 1:
            raise HttpError(400, "only n=1 is supported", "invalid_parameter", "n")
        return stream, bool(options.get("include_usage", False))

    async def chat(self, request: Json, send: Send) -> None:
        served = self._check_model(request)
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(
                400, "'messages' must be a non-empty list", "invalid_parameter", "messages"
            )
        # vLLM's and SGLang's continuation of a partial answer: the last message is the start of
        # the assistant's answer, continued without a new generation prompt.
        continuing = request.get("continue_final_message", False)
        if continuing is not False and continuing is not True:
            raise HttpError(400, "'continue_final_message' must be a boolean", "invalid_parameter")
        if continuing:
            if request.get("add_generation_prompt", True) is not False:
                raise HttpError(
                    400,
                    "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                    "invalid_parameter",
                )
            last = messages[-1]
            if not isinstance(last, dict) or last.get("role") != "assistant":
                raise HttpError(
                    400,
                    "continue_final_message needs an assistant message last",
                    "invalid_parameter",
                    "messages",
                )
            prompt = tokenize(render_chat(messages))
        else:
            prompt = tokenize(render_chat(messages) + GENERATION_PROMPT)
        await self._generate(request, send, prompt, served, chat=True, continuing=continuing)

    async def completions(self, request: Json, send: Send) -> None:
        served = self._check_model(request)
        raw = request.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if isinstance(raw, str):
            prompt = tokenize(raw)
        elif (
            isinstance(raw, list)
            and raw
            and all(isinstance(t, int) and not isinstance(t, bool) for t in raw)
        ):
            prompt = [int(t) for t in raw]
        else:
            raise HttpError(
                400,
                "'prompt' must be a string or a list of token ids",
                "invalid_parameter",
                "prompt",
            )
        # A prompt that is the start of an answer (a resumed stream) continues it mid-text.
        await self._generate(request, send, prompt, served, chat=False, continuing=True)

    async def _generate(
        self,
        request: Json,
        send: Send,
        prompt: list[int],
        served: Served,
        *,
        chat: bool,
        continuing: bool,
    ) -> None:
        """Generate for ``prompt``; ``continuing``: the answer goes on mid-text (no leading
        whitespace is stripped from its first piece)."""
        stream, include_usage = self._stream_flags(request)
        max_tokens = self._max_tokens(request, len(prompt))
        priority = request_priority(request)
        rid, tokens = self.generator.submit(prompt, max_tokens, served, priority)
        ident = self._next_id("chatcmpl" if chat else "cmpl")
        created = int(self.wall_clock())
        obj = "chat.completion" if chat else "text_completion"
        finished = False
        try:
            if not stream:
                pieces: list[str] = []
                reason: str | None = None
                cached = 0
                async for event in tokens:
                    pieces.append(detokenize(event.token))
                    reason = event.finish_reason
                    cached = event.cached if event.index == 0 else cached
                finished = True
                text = "".join(pieces) if continuing else "".join(pieces).lstrip()
                choice: Json = {"index": 0, "logprobs": None, "finish_reason": reason}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                doc = {
                    "id": ident,
                    "object": obj,
                    "created": created,
                    "model": served.name,
                    "choices": [choice],
                    "usage": self._usage(len(prompt), len(pieces), cached),
                }
                await _send_json(send, doc)
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream"),
                        (b"cache-control", b"no-cache"),
                    ],
                }
            )
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"

            async def emit(choices: list[Json], usage: Json | None = None) -> None:
                doc: Json = {
                    "id": ident,
                    "object": chunk_obj,
                    "created": created,
                    "model": served.name,
                    "choices": choices,
                }
                if usage is not None:
                    doc["usage"] = usage
                data = b"data: " + _dumps(doc) + b"\n\n"
                await send({"type": "http.response.body", "body": data, "more_body": True})

            # As vLLM: the role chunk goes out with the first token (its first iteration), so
            # the stream's first byte comes when the prompt has been computed.
            role = chat
            count = 0
            cached = 0
            first = not continuing
            async for event in tokens:
                cached = event.cached if event.index == 0 else cached
                if role:
                    await emit([_chunk_choice(chat, "", None, role=True)])
                    role = False
                count += 1
                piece = detokenize(event.token)
                if first:
                    piece, first = piece.lstrip(), False
                await emit([_chunk_choice(chat, piece, event.finish_reason)])
            if role:
                await emit([_chunk_choice(chat, "", None, role=True)])
            finished = True
            if include_usage:
                await emit([], self._usage(len(prompt), count, cached))
            await send(
                {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
            )
        finally:
            if not finished:
                self.driver.abort(rid)

    def _usage(self, prompt: int, completion: int, cached: int) -> Json:
        """A completion's usage; with ``prompt_tokens_details`` (vLLM's flag of that name) also
        the prompt tokens its prefill found in the prefix cache, as vLLM reports them."""
        usage = _usage(prompt, completion)
        if self.config.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    async def embeddings(self, request: Json, send: Send) -> None:
        served = self._check_model(request)
        raw = request.get("input")
        inputs = [raw] if isinstance(raw, str) else raw
        if (
            not isinstance(inputs, list)
            or not inputs
            or not all(isinstance(x, str) for x in inputs)
        ):
            raise HttpError(
                400, "'input' must be a string or a list of strings", "invalid_parameter", "input"
            )
        dims = request.get("dimensions", self.config.embedding_dims)
        if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= 8192:
            raise HttpError(
                400, "'dimensions' must be an integer in 1..8192", "invalid_parameter", "dimensions"
            )
        seed = self.config.engine.seed
        data = [
            {"object": "embedding", "index": i, "embedding": embedding(seed, text, dims)}
            for i, text in enumerate(cast("list[str]", inputs))
        ]
        used = sum(len(tokenize(text)) for text in cast("list[str]", inputs))
        doc = {
            "object": "list",
            "data": data,
            "model": served.name,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }
        await _send_json(send, doc)


def _chunk_choice(chat: bool, text: str, reason: str | None, *, role: bool = False) -> Json:
    choice: Json = {"index": 0, "logprobs": None, "finish_reason": reason}
    if chat:
        choice["delta"] = {"role": "assistant", "content": text} if role else {"content": text}
    else:
        choice["text"] = text
    return choice


def _usage(prompt: int, completion: int) -> Json:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _async_value(doc: Json) -> Json:
    return doc


def _crash(reason: str) -> None:
    sys.stderr.write(f"simengine: {reason}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(CRASH_EXIT_CODE)


# -- serving ----------------------------------------------------------------------------------


async def serve(
    config: SimConfig,
    sock: socket.socket,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[SimEngineApp] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the simulated engine on a bound socket until ``shutdown`` is set (in-flight requests
    then get ``shutdown_grace_s``). Fault timers run alongside; ``started`` gives the app."""
    faults = config.faults
    step_log = StepLog(config.step_log) if config.step_log is not None else None
    publisher = KvPublisher(config.kv_events) if config.kv_events is not None else None
    driver = EngineDriver(config.engine, faults.slowdown, step_log, publisher)
    app = SimEngineApp(config, driver)
    http_done = trio.Event()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(driver.run)
        await nursery.start(app.run_background)
        if faults.crash_after_s is not None:
            nursery.start_soon(_crash_after, faults.crash_after_s)
        if faults.hang_after_s is not None:
            nursery.start_soon(_hang_after, driver, faults.hang_after_s)
        await nursery.start(serve_http, app, sock, shutdown, config.shutdown_grace_s, http_done)
        task_status.started(app)
        await http_done.wait()  # hypercorn returns once in-flight requests finish or time out
        nursery.cancel_scope.cancel()
    if step_log is not None:
        step_log.close()
    if publisher is not None:
        publisher.close()


async def _crash_after(delay_s: float) -> None:
    await trio.sleep(delay_s)
    _crash(f"crashing after {delay_s:g} s (fault injection)")


async def _hang_after(driver: EngineDriver, delay_s: float) -> None:
    await trio.sleep(delay_s)
    log.warning("hanging after %g s (fault injection)", delay_s)
    driver.hung = True
