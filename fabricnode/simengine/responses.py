"""OpenAI's Responses API as vLLM 0.32 serves it (``vllm/entrypoints/openai/responses``), on
the simulated engine's generation loop.

* ``POST /v1/responses``: ``input`` a string or a list of message items (``role`` and
  ``content``: a string or ``input_text``/``output_text`` parts), ``instructions`` (a system
  message, not carried over to a follow-up), ``max_output_tokens``, ``stream``, ``store``
  (default true), ``previous_response_id`` (the stored conversation, its output included, is
  prepended), ``background`` (with ``store``: answered at once with status ``queued``, run on,
  retrievable and cancellable). The prompt is the chat prompt of those messages, so ``usage``
  and ``/tokenize`` agree with ``/v1/chat/completions``. vLLM's ``request_id`` field, when given,
  is the response's id (vLLM: ``ResponsesResponse.id = request.request_id``, default
  ``resp_<uuid>``); an ingress uses it to choose the id.
* The answer is a ``response`` object with one ``message`` output item and ``usage``
  ``{input_tokens, output_tokens, total_tokens, *_details}``. Like vLLM, a response that ran
  into its token limit (every simulated one: the engine has no end-of-sequence) has status
  ``incomplete`` and ``incomplete_details.reason = "max_output_tokens"``. Streamed, it is vLLM's
  event sequence, each event ``event: TYPE`` + ``data: {..., "type", "sequence_number"}``:
  ``response.created``, ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, one ``response.output_text.delta`` a token,
  ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
  ``response.completed``.
* ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``; an unknown id is 404 in
  vLLM's shape (``invalid_request_error``, ``param: response_id``, ``code: 404``); cancelling a
  response that is not running in the background is vLLM's 400.
* Stored responses live in a ``ResponseStore`` bounded in count and bytes, the oldest evicted
  first (vLLM's store, off unless ``VLLM_ENABLE_RESPONSES_API_STORE``, is unbounded).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from fabricnode.asgi import Send
from fabricnode.simengine.generation import Generator, chat_prompt, request_priority
from fabricnode.simengine.httpio import (
    HttpError,
    Json,
    dumps,
    send_chunk,
    send_json,
    sse_event,
    start_sse,
)
from fabricnode.simengine.lora import Models, Served
from fabricnode.simengine.model import TokenEvent, detokenize

DEFAULT_STORE_MAX_RESPONSES = 1024
DEFAULT_STORE_MAX_BYTES = 64 * 1024 * 1024


def random_hex() -> str:
    return uuid.uuid4().hex


# -- the store --------------------------------------------------------------------------------


@dataclass
class Stored:
    doc: Json  # the response object as answered
    messages: list[Json]  # the conversation it was generated from (its output not included)
    size: int


@dataclass(frozen=True)
class StoreStatistics:
    responses: int
    bytes: int
    evicted: int


class ResponseStore:
    """Responses by id, at most ``max_responses`` of them and ``max_bytes`` of JSON; putting one
    in evicts the oldest until both bounds hold. One bigger than ``max_bytes`` is not kept."""

    def __init__(
        self,
        max_responses: int = DEFAULT_STORE_MAX_RESPONSES,
        max_bytes: int = DEFAULT_STORE_MAX_BYTES,
    ) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> Stored | None:
        return self._entries.get(response_id)

    def put(self, doc: Json, messages: list[Json]) -> bool:
        """Store (or replace) ``doc`` under its id; False if it is too big to keep."""
        response_id = str(doc["id"])
        self._drop(response_id)
        size = len(dumps(doc)) + len(dumps({"m": messages}))
        if size > self.max_bytes:
            return False
        self._entries[response_id] = Stored(doc, messages, size)
        self._bytes += size
        while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self._bytes -= oldest.size
            self.evicted += 1
        return True

    def update(self, doc: Json) -> None:
        """Replace a stored response's object, keeping its place and its conversation (nothing
        if it was evicted meanwhile)."""
        entry = self._entries.get(str(doc["id"]))
        if entry is None:
            return
        size = len(dumps(doc)) + len(dumps({"m": entry.messages}))
        self._bytes += size - entry.size
        entry.doc, entry.size = doc, size

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(len(self._entries), self._bytes, self.evicted)


# -- the endpoint -----------------------------------------------------------------------------


def not_found(response_id: str) -> HttpError:
    return HttpError(
        404,
        f"Response with id '{response_id}' not found.",
        404,
        "response_id",
        kind="invalid_request_error",
    )


def _bad(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, 400, param, kind="BadRequestError")


def _input_messages(raw: object) -> list[Json]:
    """The chat messages of a request's ``input``."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise _bad("'input' must be a string or a list of input items", "input")
    messages: list[Json] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise _bad(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue  # vLLM drops reasoning items from the prompt too
        if kind != "message":
            raise _bad(
                f"input[{i}]: items of type {kind!r} are not supported by the simulated engine",
                "input",
            )
        role, content = item.get("role"), item.get("content")
        if role not in ("user", "assistant", "system", "developer"):
            raise _bad(f"input[{i}].role must be user, assistant, system or developer", "input")
        if isinstance(content, list):
            texts: list[str] = []
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                    raise _bad(f"input[{i}].content: only text parts are supported", "input")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise _bad(f"input[{i}].content must be a string or a list of text parts", "input")
        messages.append({"role": role, "content": content})
    if not messages:
        raise _bad("'input' has no message", "input")
    return messages


def _output_texts(doc: Json) -> list[str]:
    texts: list[str] = []
    for item in doc.get("output", []):
        if isinstance(item, dict) and item.get("type") == "message":
            texts.extend(
                str(part.get("text", ""))
                for part in item.get("content", [])
                if isinstance(part, dict) and part.get("type") == "output_text"
            )
    return texts


def _usage(prompt: int, output: int) -> Json:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [prompt],
            "cached_tokens_per_turn": [0],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [output],
            "tool_output_tokens_per_turn": [0],
        },
        "total_tokens": prompt + output,
    }


def _text_part(text: str, logprobs: list[Any] | None = None) -> Json:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, text: str | None, status: str) -> Json:
    content = [] if not text else [_text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "status": status,
    }


@dataclass
class _Plan:
    """A checked request."""

    response_id: str
    served: Served
    messages: list[Json]
    prompt: list[int]
    max_tokens: int
    stream: bool
    store: bool
    background: bool
    request: Json
    priority: int = 0  # vLLM's priority field (lower first; needs the priority policy)


class ResponsesAPI:
    def __init__(
        self,
        models: Models,
        generator: Generator,
        store: ResponseStore,
        wall_clock: Callable[[], float],
        new_id: Callable[[], str] = random_hex,
    ) -> None:
        self.models = models
        self.generator = generator
        self.store = store
        self.wall_clock = wall_clock
        self.new_id = new_id
        self.nursery: trio.Nursery | None = None  # runs background responses (server.serve)
        self._running: dict[str, trio.CancelScope] = {}

    # -- documents --

    def _doc(
        self,
        plan: _Plan,
        created: int,
        status: str,
        output: list[Json],
        usage: Json | None,
    ) -> Json:
        request = plan.request
        temperature = request.get("temperature")
        top_p = request.get("top_p")
        return {
            "id": plan.response_id,
            "created_at": created,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": request.get("instructions"),
            "metadata": request.get("metadata"),
            "model": plan.served.name,
            "object": "response",
            "output": output,
            "parallel_tool_calls": request.get("parallel_tool_calls", True) is not False,
            "temperature": temperature if isinstance(temperature, int | float) else 1.0,
            "tool_choice": "none",
            "tools": [],
            "top_p": top_p if isinstance(top_p, int | float) else 1.0,
            "background": plan.background,
            "max_output_tokens": plan.max_tokens,
            "max_tool_calls": request.get("max_tool_calls"),
            "previous_response_id": request.get("previous_response_id"),
            "prompt": None,
            "reasoning": None,
            "service_tier": request.get("service_tier", "auto"),
            "status": status,
            "text": request.get("text"),
            "top_logprobs": None,
            "truncation": request.get("truncation", "disabled"),
            "usage": usage,
            "user": request.get("user"),
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def _plan(self, request: Json) -> _Plan:
        served = self.models.resolve(request.get("model"))
        flags: dict[str, bool] = {}
        for name, default in (("stream", False), ("store", True), ("background", False)):
            value = request.get(name, default)
            if value is None:
                value = default
            if not isinstance(value, bool):
                raise _bad(f"'{name}' must be a boolean", name)
            flags[name] = value
        if flags["background"] and not flags["store"]:
            raise _bad("background can only be used when `store` is true", "background")
        if flags["background"] and flags["stream"]:
            raise _bad(
                "background streaming is not supported by the simulated engine", "background"
            )
        instructions = request.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions")
        response_id = request.get("request_id")
        if response_id is None:
            response_id = f"resp_{self.new_id()}"
        elif not isinstance(response_id, str) or not response_id:
            raise _bad("'request_id' must be a non-empty string", "request_id")
        messages: list[Json] = []
        if instructions:
            messages.append({"role": "system", "content": instructions})
        previous_id = request.get("previous_response_id")
        if previous_id is not None:
            if not isinstance(previous_id, str):
                raise _bad("'previous_response_id' must be a string", "previous_response_id")
            previous = self.store.get(previous_id)
            if previous is None:
                raise not_found(previous_id)
            # As vLLM: the earlier conversation without its instructions, then its output.
            messages.extend(m for m in previous.messages if m.get("role") != "system")
            messages.extend(
                {"role": "assistant", "content": t} for t in _output_texts(previous.doc)
            )
        messages.extend(_input_messages(request.get("input")))
        prompt = chat_prompt(messages)
        max_tokens = self.generator.max_tokens(
            request.get("max_output_tokens"), len(prompt), "max_output_tokens"
        )
        return _Plan(
            response_id,
            served,
            messages,
            prompt,
            max_tokens,
            flags["stream"],
            flags["store"],
            flags["background"],
            request,
            request_priority(request),
        )

    # -- endpoints --

    async def create(self, request: Json, send: Send) -> None:
        plan = self._plan(request)
        created = int(self.wall_clock())
        if plan.background:
            if self.nursery is None:
                raise _bad("background responses need the serving engine", "background")
            # Queued now, so a request that can never fit is refused here, not stored failed.
            rid, tokens = self.generator.submit(
                plan.prompt, plan.max_tokens, plan.served, plan.priority
            )
            doc = self._doc(plan, created, "queued", [], None)
            self.store.put(doc, plan.messages)
            scope = trio.CancelScope()
            self._running[plan.response_id] = scope
            self.nursery.start_soon(self._run_background, plan, created, scope, rid, tokens)
            await send_json(send, doc)
            return
        if plan.stream:
            await self._stream(plan, created, send)
            return
        item_id = f"msg_{self.new_id()}"
        async with self.generator.run(
            plan.prompt, plan.max_tokens, plan.served, plan.priority
        ) as tokens:
            pieces = [detokenize(event.token) async for event in tokens]
        doc = self._finished_doc(plan, created, item_id, pieces)
        if plan.store:
            self.store.put(doc, plan.messages)
        await send_json(send, doc)

    def _finished_doc(self, plan: _Plan, created: int, item_id: str, pieces: list[str]) -> Json:
        text = "".join(pieces).lstrip()
        status = "incomplete" if len(pieces) >= plan.max_tokens else "completed"
        output = [_message_item(item_id, text, "completed")]
        return self._doc(plan, created, status, output, _usage(len(plan.prompt), len(pieces)))

    async def _run_background(
        self,
        plan: _Plan,
        created: int,
        scope: trio.CancelScope,
        rid: int,
        tokens: trio.MemoryReceiveChannel[TokenEvent],
    ) -> None:
        item_id = f"msg_{self.new_id()}"
        pieces: list[str] = []
        try:
            with scope:
                stored = self.store.get(plan.response_id)
                if stored is not None:
                    self.store.update({**stored.doc, "status": "in_progress"})
                async with self.generator.owned(rid, tokens):
                    async for event in tokens:
                        pieces.append(detokenize(event.token))
        finally:
            self._running.pop(plan.response_id, None)
        if scope.cancelled_caught:
            return  # cancel() has stored the cancelled response
        stored = self.store.get(plan.response_id)
        if stored is not None and stored.doc.get("status") != "cancelled":
            self.store.update(self._finished_doc(plan, created, item_id, pieces))

    async def retrieve(self, response_id: str, send: Send) -> None:
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        await send_json(send, stored.doc)

    async def cancel(self, response_id: str, send: Send) -> None:
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        if stored.doc.get("status") not in ("queued", "in_progress"):
            raise HttpError(
                400,
                "Cannot cancel a synchronous response.",
                400,
                "response_id",
                kind="invalid_request_error",
            )
        doc = {**stored.doc, "status": "cancelled"}
        self.store.update(doc)
        scope = self._running.pop(response_id, None)
        if scope is not None:
            scope.cancel()  # aborts the engine request: its slot and KV blocks are freed
        await send_json(send, doc)

    async def _stream(self, plan: _Plan, created: int, send: Send) -> None:
        sequence = 0

        async def emit(doc: Json) -> None:
            nonlocal sequence
            doc["sequence_number"] = sequence
            sequence += 1
            await send_chunk(send, sse_event(str(doc["type"]), doc))

        item_id = f"msg_{self.new_id()}"
        async with self.generator.run(
            plan.prompt, plan.max_tokens, plan.served, plan.priority
        ) as tokens:
            await start_sse(send)
            initial = self._doc(plan, created, "in_progress", [], None)
            await emit({"type": "response.created", "response": initial})
            await emit({"type": "response.in_progress", "response": initial})
            await emit(
                {
                    "type": "response.output_item.added",
                    "output_index": 0,
                    "item": _message_item(item_id, None, "in_progress"),
                }
            )
            await emit(
                {
                    "type": "response.content_part.added",
                    "output_index": 0,
                    "item_id": item_id,
                    "content_index": 0,
                    "part": _text_part("", []),
                }
            )
            pieces: list[str] = []
            async for event in tokens:
                piece = detokenize(event.token)
                if not pieces:
                    piece = piece.lstrip()
                pieces.append(piece)
                await emit(
                    {
                        "type": "response.output_text.delta",
                        "content_index": 0,
                        "output_index": 0,
                        "item_id": item_id,
                        "delta": piece,
                        "logprobs": [],
                    }
                )
        text = "".join(pieces)
        await emit(
            {
                "type": "response.output_text.done",
                "output_index": 0,
                "content_index": 0,
                "text": text,
                "logprobs": [],
                "item_id": item_id,
            }
        )
        await emit(
            {
                "type": "response.content_part.done",
                "item_id": item_id,
                "output_index": 0,
                "content_index": 0,
                "part": _text_part(text),
            }
        )
        await emit(
            {
                "type": "response.output_item.done",
                "output_index": 0,
                "item": _message_item(item_id, text, "completed"),
            }
        )
        final = self._finished_doc(plan, created, item_id, pieces)
        if plan.store:
            self.store.put(final, plan.messages)
        await emit({"type": "response.completed", "response": final})
        await send_chunk(send, b"", last=True)
