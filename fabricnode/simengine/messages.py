"""Anthropic's Messages API as vLLM 0.32 serves it (``vllm/entrypoints/anthropic``): a request
is turned into a chat request, so it loads the engine and counts tokens exactly as
``/v1/chat/completions`` does.

* ``POST /v1/messages``: ``model``, ``messages`` (``user``/``assistant``, content a string or
  ``text`` blocks), ``system`` (a string or ``text`` blocks), ``max_tokens`` (required),
  ``stream``. The answer is a ``message`` object (``content: [{"type": "text", ...}]``,
  ``stop_reason`` ``max_tokens`` (the simulated engine stops only at its limit),
  ``stop_sequence`` null, ``usage {input_tokens, output_tokens}``). Streamed, Anthropic's named
  events: ``message_start``, ``content_block_start``, ``ping``, a ``content_block_delta``
  (``text_delta``) a token, ``content_block_stop``, ``message_delta`` (``stop_reason``, usage
  with ``output_tokens``), ``message_stop``.
* ``POST /v1/messages/count_tokens`` → ``{"input_tokens", "context_management"}``.
* Errors on these paths have Anthropic's shape ``{"type": "error", "error": {"type",
  "message"}}`` (the app converts them: ``httpio.anthropic_error_doc``), with vLLM's error types
  (``NotFoundError`` for an unknown model, 404).

Where it differs from vLLM: ids are ``msg_<hex>`` (Anthropic's form; vLLM reuses the chat
completion's ``chatcmpl-...``), ``stop_sequence: null`` is sent (vLLM omits null fields), a
``ping`` follows ``content_block_start`` as in Anthropic's own streams (vLLM sends none), and a
request that fails validation (``max_tokens`` missing) is answered in Anthropic's shape (vLLM's
request validation answers those in the OpenAI shape).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from fabricnode.asgi import Send
from fabricnode.simengine.generation import Generator, chat_prompt, positive_int
from fabricnode.simengine.httpio import HttpError, Json, send_chunk, send_json, sse_event, start_sse
from fabricnode.simengine.lora import Models, Served
from fabricnode.simengine.model import detokenize


def random_hex() -> str:
    return uuid.uuid4().hex


def _bad(message: str) -> HttpError:
    return HttpError(400, message, 400, kind="BadRequestError")


def _text_of(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content blocks")
    texts: list[str] = []
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise _bad(f"{where}[{i}] must be an object")
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise _bad(
                f"{where}[{i}]: content blocks of type {kind!r} are not supported by the "
                "simulated engine"
            )
    return "".join(texts)


def chat_messages(request: Json) -> list[Json]:
    """The chat conversation of a Messages request: ``system`` first, then ``messages``."""
    messages: list[Json] = []
    system = request.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    raw = request.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages: a non-empty list of messages is required")
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise _bad(f"messages[{i}].role must be 'user' or 'assistant'")
        messages.append(
            {"role": role, "content": _text_of(message.get("content"), f"messages[{i}].content")}
        )
    return messages


class MessagesAPI:
    def __init__(
        self,
        models: Models,
        generator: Generator,
        new_id: Callable[[], str] = random_hex,
    ) -> None:
        self.models = models
        self.generator = generator
        self.new_id = new_id

    def _served(self, request: Json) -> Served:
        model = request.get("model")
        if not isinstance(model, str) or not model:
            raise _bad("model: a model name is required")
        return self.models.resolve(model)

    async def count_tokens(self, request: Json, send: Send) -> None:
        self._served(request)
        count = len(chat_prompt(chat_messages(request)))
        await send_json(
            send, {"input_tokens": count, "context_management": {"original_input_tokens": count}}
        )

    async def create(self, request: Json, send: Send) -> None:
        served = self._served(request)
        if "max_tokens" not in request:
            raise _bad("max_tokens: Field required")
        max_tokens = positive_int(request["max_tokens"], "max_tokens")
        stream = request.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise _bad("stream must be a boolean")
        prompt = chat_prompt(chat_messages(request))
        ident = f"msg_{self.new_id()}"
        if not stream:
            async with self.generator.run(prompt, max_tokens, served) as tokens:
                pieces = [detokenize(event.token) async for event in tokens]
            doc = {
                "id": ident,
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": "".join(pieces).lstrip()}],
                "model": served.name,
                "stop_reason": _stop_reason(len(pieces), max_tokens),
                "stop_sequence": None,
                "usage": {"input_tokens": len(prompt), "output_tokens": len(pieces)},
            }
            await send_json(send, doc)
            return

        async def emit(event: str, doc: dict[str, Any]) -> None:
            await send_chunk(send, sse_event(event, {"type": event, **doc}))

        async with self.generator.run(prompt, max_tokens, served) as tokens:
            await start_sse(send)
            start: Json = {
                "id": ident,
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": served.name,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": len(prompt), "output_tokens": 0},
            }
            await emit("message_start", {"message": start})
            await emit(
                "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
            )
            await emit("ping", {})
            count = 0
            async for event in tokens:
                piece = detokenize(event.token)
                if not count:
                    piece = piece.lstrip()
                count += 1
                await emit(
                    "content_block_delta",
                    {"index": 0, "delta": {"type": "text_delta", "text": piece}},
                )
        await emit("content_block_stop", {"index": 0})
        await emit(
            "message_delta",
            {
                "delta": {"stop_reason": _stop_reason(count, max_tokens), "stop_sequence": None},
                "usage": {"input_tokens": len(prompt), "output_tokens": count},
            },
        )
        await emit("message_stop", {})
        await send_chunk(send, b"", last=True)


def _stop_reason(produced: int, max_tokens: int) -> str:
    # vLLM maps finish_reason "length" to "max_tokens" and "stop" to "end_turn".
    return "max_tokens" if produced >= max_tokens else "end_turn"
