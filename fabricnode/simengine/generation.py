"""Running a prompt on the simulated engine, for every endpoint that generates: the chat prompt
every chat-shaped API renders to (so ``/tokenize``, ``usage`` and the KV accounting agree), the
``max_tokens`` rule, vLLM's ``priority`` field, and a request's tokens as an async context that
aborts the request when the caller leaves early (a client gone, a cancelled response), freeing its
batch slot and KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import trio

from fabricnode.simengine.httpio import HttpError
from fabricnode.simengine.lora import Served
from fabricnode.simengine.model import TokenEvent, tokenize

DEFAULT_MAX_TOKENS = 256
GENERATION_PROMPT = "\nassistant:"


class Driver(Protocol):
    """What generating needs of ``driver.EngineDriver``."""

    def submit(
        self, prompt: list[int], max_tokens: int, salt: bytes = b"", priority: int = 0
    ) -> tuple[int, trio.MemoryReceiveChannel[TokenEvent]]: ...

    def abort(self, rid: int) -> None: ...


def render_chat(messages: list[Any]) -> str:
    """The text a chat conversation is tokenized from: one ``role: content`` line a message
    (text parts of a content list joined). ``HttpError`` 400 for a malformed message."""
    lines: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise HttpError(
                400,
                f"messages[{i}] must be an object with a 'role'",
                "invalid_parameter",
                "messages",
            )
        content = message.get("content")
        if isinstance(content, list):
            parts = [
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            ]
            content = "".join(str(p) for p in parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise HttpError(
                400,
                f"messages[{i}].content must be a string or a list of parts",
                "invalid_parameter",
                "messages",
            )
        lines.append(f"{message['role']}: {content}")
    return "\n".join(lines)


def chat_prompt(messages: list[Any], *, add_generation_prompt: bool = True) -> list[int]:
    """The prompt tokens of a conversation, as ``/v1/chat/completions`` computes them."""
    text = render_chat(messages)
    return tokenize(text + GENERATION_PROMPT if add_generation_prompt else text)


def request_priority(request: dict[str, Any]) -> int:
    """The request's ``priority`` field (vLLM's: an integer, lower is served first; default 0).
    ``HttpError`` 400 when it is not an integer; whether the engine accepts a non-zero one is
    the scheduler's to say (``Scheduler.submit``)."""
    value = request.get("priority", 0)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise HttpError(400, "'priority' must be an integer", "invalid_parameter", "priority")
    return value


def positive_int(value: object, param: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HttpError(400, f"{param} must be a positive integer", "invalid_parameter", param)
    return value


class Generator:
    """Submits prompts to the driver on behalf of an endpoint."""

    def __init__(
        self, driver: Driver, max_model_len: int, default_max_tokens: int = DEFAULT_MAX_TOKENS
    ) -> None:
        self.driver = driver
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens

    def max_tokens(self, value: object, prompt_len: int, param: str = "max_tokens") -> int:
        """``value`` checked, or (None) the default: at most ``default_max_tokens`` and what
        the context has room for."""
        if value is None:
            return max(1, min(self.default_max_tokens, self.max_model_len - prompt_len))
        return positive_int(value, param)

    def submit(
        self, prompt: list[int], max_tokens: int, served: Served, priority: int = 0
    ) -> tuple[int, trio.MemoryReceiveChannel[TokenEvent]]:
        """Queue a request; 400 (the scheduler's one line) if it can never be served, or has a
        non-zero ``priority`` while the engine schedules first come, first served."""
        try:
            return self.driver.submit(prompt, max_tokens, served.salt, priority)
        except ValueError as exc:
            raise HttpError(400, str(exc), "invalid_request") from None

    @asynccontextmanager
    async def run(
        self, prompt: list[int], max_tokens: int, served: Served, priority: int = 0
    ) -> AsyncIterator[trio.MemoryReceiveChannel[TokenEvent]]:
        """The request's tokens; leaving the block before the last one aborts it."""
        rid, tokens = self.submit(prompt, max_tokens, served, priority)
        async with self.owned(rid, tokens):
            yield tokens

    @asynccontextmanager
    async def owned(
        self, rid: int, tokens: trio.MemoryReceiveChannel[TokenEvent]
    ) -> AsyncIterator[trio.MemoryReceiveChannel[TokenEvent]]:
        """The tokens of a request already submitted; leaving early aborts it."""
        try:
            yield tokens
        finally:
            self.driver.abort(rid)  # a no-op once it has finished

    async def collect(self, prompt: list[int], max_tokens: int, served: Served) -> list[int]:
        """Every output token of a request, once it has finished."""
        async with self.run(prompt, max_tokens, served) as tokens:
            return [event.token async for event in tokens]
