"""Resuming a stream whose serving node died mid-answer: the pure part (no sockets).

When a streamed chat or text completion breaks after the client has received part of the
answer, the ingress continues the same generation on another node serving the model, in the
manner of NVIDIA Dynamo's request migration but without any change to the engines:

1. ``Transcript`` keeps the SSE bytes the client received (bounded per stream, and by a
   ``TranscriptBudget`` across all streams of the agent).
2. ``read_delivered`` reads them back: the stream's id, ``created`` and model, the text delivered
   so far and how many tokens it took (one per content event; engines send one per token).
3. ``continuation`` re-sends the original request with that text as the start of the answer:
   for chat, the partial assistant message with ``continue_final_message: true`` and
   ``add_generation_prompt: false`` (vLLM's and SGLang's chat APIs); for completions,
   prompt + text so far; ``max_tokens`` (or ``max_completion_tokens``) reduced by the tokens
   delivered.
4. ``Splicer`` rewrites the new node's events into the client's stream: the original id,
   ``created`` and model, no second role chunk, and usage that counts the whole answer once
   (completion tokens delivered before plus after; prompt tokens the continuation's less the
   delivered ones it re-read as prompt).

The continuation is a new sample from the same prefix: it is what the model could have written,
not what the dead node would have written. A stream that broke before its first event (the node
sent its head and died) is sent again whole, and the new node's events pass unchanged. Where a
resume cannot be faithful the stream ends with the usual error event instead (``not_resumable``,
``read_delivered``): several choices, logprobs, tool calls or reasoning content in the answer,
structured output, an event cut in half, or ``X-Fabric-Resume: off``.
"""

from __future__ import annotations

from typing import Any

import orjson

from fabricnode.dataplane.endpoints import sse_data

RESUME_HEADER = b"x-fabric-resume"  # "off": end a broken stream with the error event instead
MAX_TRANSCRIPT_BYTES = 4 * 1024 * 1024  # per stream; a longer stream is not resumed

# Request fields that constrain the output's form: a continuation cannot be held to them.
_STRUCTURED = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


class TranscriptBudget:
    """The bytes every live transcript may hold together (the agent's global bound)."""

    __slots__ = ("max_bytes", "used")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0


class Transcript:
    """The SSE bytes a client received of one stream, while they fit the budgets."""

    __slots__ = ("budget", "full", "pieces", "size")

    def __init__(self, budget: TranscriptBudget) -> None:
        self.budget = budget
        self.pieces: list[bytes] = []
        self.size = 0
        self.full = False  # over a budget once: dropped, and the stream is not resumable

    def add(self, pieces: list[bytes]) -> None:
        if self.full:
            return
        n = 0
        for piece in pieces:
            n += len(piece)
        budget = self.budget
        if self.size + n > MAX_TRANSCRIPT_BYTES or budget.used + n > budget.max_bytes:
            self.full = True
            self.release()
            return
        self.pieces.extend(pieces)
        self.size += n
        budget.used += n

    def release(self) -> None:
        """Give the bytes back to the budget (the stream ended, or the transcript overflowed)."""
        self.budget.used -= self.size
        self.size = 0
        self.pieces = []


class Delivered:
    """What the client holds of a broken stream."""

    __slots__ = ("created", "fingerprint", "ident", "model", "obj", "text", "tokens")

    def __init__(self) -> None:
        self.ident: Any = None
        self.created: Any = None
        self.model: Any = None
        self.obj: Any = None
        self.fingerprint: Any = None
        self.text = ""
        self.tokens = 0

    @property
    def nothing(self) -> bool:
        """The stream broke before its first event: the client holds none of the answer."""
        return self.ident is None and not self.text and not self.tokens


def turned_off(opt_out: bytes | None) -> bool:
    """The client asked for a broken stream to end with its error event (``X-Fabric-Resume``)."""
    return opt_out is not None and opt_out.strip().lower() in (b"off", b"0", b"false", b"no")


def not_resumable(kind: str, doc: dict[str, Any] | None, opt_out: bytes | None) -> str:
    """Why this request's stream cannot be resumed ("" if it can)."""
    if turned_off(opt_out):
        return "resume turned off by X-Fabric-Resume"
    if doc is None or kind not in ("chat", "completions"):
        return "not a chat or text completion"
    if doc.get("n", 1) != 1 or doc.get("best_of", 1) not in (1, None):
        return "several choices"
    if doc.get("logprobs") or doc.get("top_logprobs"):
        return "logprobs were asked for"
    if any(doc.get(name) is not None for name in _STRUCTURED):
        return "structured output"
    if kind == "completions":
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return "the prompt is not one string"
        if doc.get("echo") or doc.get("suffix") is not None:
            return "echo or suffix"
    elif not isinstance(doc.get("messages"), list):
        return "no messages"
    return ""


def read_delivered(pieces: list[bytes], kind: str) -> Delivered | str:
    """Read back what the client received; a reason (str) when it cannot be continued."""
    data = b"".join(pieces).replace(b"\r\n", b"\n")
    got = Delivered()
    if not data.strip():
        # The node answered with its head and died before its first event: the client holds
        # an open stream and nothing of the answer, so the whole request goes to another node.
        return got
    if not data.endswith(b"\n\n"):
        return "the stream broke inside an event"
    text: list[str] = []
    events = 0
    for event in data.split(b"\n\n"):
        payload = _payload(event)
        if payload is None:
            continue  # a comment (keep-alive): nothing of the answer
        events += 1
        if payload == b"[DONE]":
            return "the stream had ended"
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return "an event that is not JSON"
        if not isinstance(doc, dict) or "error" in doc:
            return "the stream carried an error"
        if got.ident is None:
            got.ident, got.created = doc.get("id"), doc.get("created")
            got.model, got.obj = doc.get("model"), doc.get("object")
        if doc.get("system_fingerprint") is not None:
            got.fingerprint = doc.get("system_fingerprint")
        choices = doc.get("choices")
        if not isinstance(choices, list):
            return "an event without choices"
        if len(choices) > 1:
            return "several choices"
        for choice in choices:
            why = _examine_choice(choice, kind, text, got)
            if why:
                return why
    got.text = "".join(text)
    if events and got.ident is None:
        return "events without an id"
    return got


def _payload(event: bytes) -> bytes | None:
    lines = [line for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    parts = [sse_data(line) for line in lines]
    return parts[0] if len(parts) == 1 else b"\n".join(parts)


def _examine_choice(choice: Any, kind: str, text: list[str], got: Delivered) -> str:
    if not isinstance(choice, dict) or choice.get("index", 0) != 0:
        return "several choices"
    if choice.get("logprobs"):
        return "logprobs in the answer"
    if choice.get("finish_reason") is not None:
        return "the answer had finished"
    if kind == "chat":
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return "a chunk without a delta"
        if delta.get("tool_calls") or delta.get("function_call"):
            return "a tool call"
        if delta.get("reasoning_content") or delta.get("reasoning"):
            return "reasoning content"
        piece = delta.get("content")
    else:
        piece = choice.get("text")
    if piece is None:
        return ""
    if not isinstance(piece, str):
        return "content that is not text"
    if piece:
        text.append(piece)
        got.tokens += 1
    return ""


def plan_continuation(
    kind: str,
    doc: dict[str, Any] | None,
    opt_out: bytes | None,
    transcript: Transcript,
    *,
    resumes_left: int,
) -> tuple[bytes, Splicer] | str:
    """The continuation of a broken stream: its request body and the splicer of its events,
    or why there is none."""
    if resumes_left <= 0:
        return "resumed too often"
    if transcript.full:
        return "too long to keep"
    why = not_resumable(kind, doc, opt_out)
    if why or doc is None:
        return why or "no request"
    got = read_delivered(transcript.pieces, kind)
    if isinstance(got, str):
        return got
    body = continuation(kind, doc, got)
    if isinstance(body, str):
        return body
    return body, Splicer(got, kind)


def continuation(kind: str, doc: dict[str, Any], got: Delivered) -> bytes | str:
    """The request that continues the answer on another node (or why there is none)."""
    new = dict(doc)
    for name in ("max_completion_tokens", "max_tokens"):
        limit = doc.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - got.tokens < 1:
                return "no tokens left to generate"
            new[name] = limit - got.tokens
    if got.nothing:
        return orjson.dumps(new)  # nothing delivered: the request as the client sent it
    if kind == "chat":
        messages = list(doc["messages"])
        messages.append({"role": "assistant", "content": got.text})
        new["messages"] = messages
        new["continue_final_message"] = True
        new["add_generation_prompt"] = False
    else:
        prompt = doc["prompt"]
        if isinstance(prompt, list):
            prompt = prompt[0]
        new["prompt"] = prompt + got.text
    return orjson.dumps(new)


class Splicer:
    """Rewrites a continuation's SSE events into the client's stream (fed in any split)."""

    __slots__ = ("_partial", "got", "kind", "tokens")

    def __init__(self, got: Delivered, kind: str) -> None:
        self.got = got
        self.kind = kind
        self._partial = b""
        self.tokens = 0  # content events of the continuation spliced so far

    def feed(self, pieces: list[bytes]) -> list[bytes]:
        """The client's bytes for these upstream pieces (complete events only; the rest waits)."""
        data = self._partial + b"".join(pieces)
        data = data.replace(b"\r\n", b"\n")
        end = data.rfind(b"\n\n")
        if end < 0:
            self._partial = data
            return []
        self._partial = data[end + 2 :]
        out: list[bytes] = []
        for event in data[:end].split(b"\n\n"):
            rewritten = self._event(event)
            if rewritten:
                out.append(rewritten)
        return out

    def _event(self, event: bytes) -> bytes:
        payload = _payload(event)
        if payload is None or payload == b"[DONE]":
            return event + b"\n\n" if payload is not None else b""
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event + b"\n\n"
        if not isinstance(doc, dict) or "error" in doc:
            return event + b"\n\n"
        got = self.got
        if got.nothing:
            return event + b"\n\n"  # nothing was delivered: the new node's stream is the answer
        doc["id"], doc["created"] = got.ident, got.created
        if got.model is not None:
            doc["model"] = got.model
        if got.fingerprint is not None:
            doc["system_fingerprint"] = got.fingerprint
        choices = doc.get("choices")
        if isinstance(choices, list) and choices and not self._keep(choices[0]):
            return b""
        usage = doc.get("usage")
        if isinstance(usage, dict):
            _whole_answer_usage(usage, got.tokens)
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    def _keep(self, choice: Any) -> bool:
        """Count a content event; drop the continuation's opening role chunk."""
        if not isinstance(choice, dict):
            return True
        if self.kind == "chat":
            delta = choice.get("delta")
            if isinstance(delta, dict):
                delta.pop("role", None)
                piece = delta.get("content")
                empty = not piece and all(name == "content" for name in delta)
                if empty and choice.get("finish_reason") is None:
                    return False
            else:
                piece = None
        else:
            piece = choice.get("text")
        if isinstance(piece, str) and piece:
            self.tokens += 1
        return True


def _whole_answer_usage(usage: dict[str, Any], delivered: int) -> None:
    """The continuation read the delivered tokens as prompt and generated the rest: report
    them as completion tokens, once."""
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        usage["prompt_tokens"] = max(0, prompt - delivered)
        usage["completion_tokens"] = completion + delivered
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
