"""vLLM 0.32's speech-to-text endpoints (``vllm/entrypoints/speech_to_text``) on the simulated
engine: ``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations``.

The request is ``multipart/form-data`` (parsed with python-multipart, the parser Starlette and
so vLLM use) with ``file`` (a WAV: PCM read by the standard library's ``wave``), ``model``, and
optional ``language`` (default ``en``), ``prompt``, ``response_format`` (``json`` default,
``text``, ``verbose_json``), ``stream``, ``stream_include_usage``, ``max_completion_tokens``.
The body is bounded (``max_upload_bytes``, vLLM's ``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB`` of 25 MB by
default): past it, vLLM's 400 ``Maximum file size exceeded``. A malformed body, a missing file or
a file that is not a readable WAV is 400.

The audio is a prompt of ``AUDIO_TOKENS_PER_S`` tokens a second (at least one) hashed from its
samples, the task and the language, generated like any request (``SPOKEN_TOKENS_PER_S`` a
second of audio, at least one), so the text is a pure function of the audio and the endpoint
loads the engine. Answers as vLLM's: ``{"text", "usage": {"type": "duration", "seconds"}}`` for
a transcription (seconds rounded up), ``{"text"}`` for a translation; ``verbose_json`` adds
``duration``, ``language`` and one segment; streamed, ``transcription.chunk`` (or
``translation.chunk``) events, one a token, a usage chunk with ``stream_include_usage``, then
``data: [DONE]``. Like vLLM, ``response_format=text`` is answered with the same JSON object as
``json`` (OpenAI's own API sends plain text there).
"""

from __future__ import annotations

import hashlib
import io
import math
import uuid
import wave
from collections.abc import Callable
from dataclasses import dataclass

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from fabricnode.asgi import Send
from fabricnode.simengine.generation import Generator, positive_int
from fabricnode.simengine.httpio import (
    HttpError,
    Json,
    send_chunk,
    send_json,
    sse_data,
    start_sse,
)
from fabricnode.simengine.lora import Models, Served
from fabricnode.simengine.model import VOCAB_SIZE, detokenize

AUDIO_TOKENS_PER_S = 10.0
SPOKEN_TOKENS_PER_S = 2.5
DEFAULT_MAX_UPLOAD_BYTES = 25 * 1024 * 1024  # vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB
FORM_OVERHEAD_BYTES = 64 * 1024  # the other fields and the part headers
MAX_FIELD_BYTES = 16 * 1024
FORMATS = ("json", "text", "verbose_json", "diarized_json", "srt", "vtt")


def random_hex() -> str:
    return uuid.uuid4().hex


def _bad(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, 400, param, kind="BadRequestError")


@dataclass(frozen=True)
class Audio:
    duration_s: float
    digest: bytes


@dataclass
class _Part:
    headers: dict[bytes, bytes]
    data: bytearray


def parse_form(body: bytes, content_type: str | None, max_file_bytes: int) -> dict[str, bytes]:
    """The fields of a ``multipart/form-data`` body by name (a file's content as its value);
    400 for another content type, a malformed body, a field too long or a file too big."""
    kind, options = parse_options_header(content_type or "")
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise _bad("the request must be multipart/form-data with a boundary")
    parts: list[_Part] = []
    field_name: list[bytes] = []
    field_value: list[bytes] = []
    ended: list[bool] = []

    def on_part_begin() -> None:
        parts.append(_Part({}, bytearray()))

    def on_part_data(data: bytes, start: int, end: int) -> None:
        parts[-1].data += data[start:end]

    def on_header_field(data: bytes, start: int, end: int) -> None:
        field_name.append(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        field_value.append(data[start:end])

    def on_header_end() -> None:
        parts[-1].headers[b"".join(field_name).lower()] = b"".join(field_value)
        field_name.clear()
        field_value.clear()

    def on_end() -> None:
        ended.append(True)

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": on_part_begin,
            "on_part_data": on_part_data,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_end": on_end,
        },
    )
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError as exc:
        raise _bad(f"malformed multipart body: {exc}") from None
    if not ended:
        raise _bad("malformed multipart body: it ends before its closing boundary")
    fields: dict[str, bytes] = {}
    for part in parts:
        _, disposition = parse_options_header(part.headers.get(b"content-disposition", b""))
        name = disposition.get(b"name", b"").decode("utf-8", "replace")
        is_file = b"filename" in disposition
        if is_file and len(part.data) > max_file_bytes:
            raise _bad("Maximum file size exceeded", "audio_filesize_mb")
        if not is_file and len(part.data) > MAX_FIELD_BYTES:
            raise _bad(f"form field {name!r} is too long", name)
        fields.setdefault(name, bytes(part.data))
    return fields


def read_wav(data: bytes) -> Audio:
    """Duration and digest of a PCM WAV file; 400 if it is not one."""
    try:
        with wave.open(io.BytesIO(data), "rb") as wav:
            channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
            frames = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError, ValueError) as exc:
        raise _bad(
            f"Invalid or unsupported audio file: {exc or 'not a WAV file'}", "file"
        ) from None
    if rate <= 0 or channels <= 0 or width <= 0:
        raise _bad("Invalid or unsupported audio file: bad WAV header", "file")
    count = len(frames) // (channels * width)
    return Audio(count / rate, hashlib.blake2b(frames, digest_size=16).digest())


def audio_prompt(audio: Audio, task: str, language: str) -> list[int]:
    n = max(1, math.ceil(audio.duration_s * AUDIO_TOKENS_PER_S))
    seed = audio.digest + task.encode() + b"\0" + language.encode()
    tokens: list[int] = []
    counter = 0
    while len(tokens) < n:
        block = hashlib.blake2b(seed + counter.to_bytes(4, "big"), digest_size=64).digest()
        tokens.extend(int.from_bytes(block[i : i + 4], "big") % VOCAB_SIZE for i in range(0, 64, 4))
        counter += 1
    return tokens[:n]


class AudioAPI:
    def __init__(
        self,
        models: Models,
        generator: Generator,
        *,
        wall_clock: Callable[[], float],
        max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
        new_id: Callable[[], str] = random_hex,
    ) -> None:
        self.models = models
        self.generator = generator
        self.wall_clock = wall_clock
        self.max_upload_bytes = max_upload_bytes
        self.new_id = new_id

    @property
    def body_limit(self) -> int:
        return self.max_upload_bytes + FORM_OVERHEAD_BYTES

    async def transcriptions(self, body: bytes, content_type: str | None, send: Send) -> None:
        await self._speech_to_text("transcribe", body, content_type, send)

    async def translations(self, body: bytes, content_type: str | None, send: Send) -> None:
        await self._speech_to_text("translate", body, content_type, send)

    async def _speech_to_text(
        self, task: str, body: bytes, content_type: str | None, send: Send
    ) -> None:
        fields = parse_form(body, content_type, self.max_upload_bytes)

        def text(name: str, default: str | None = None) -> str | None:
            value = fields.get(name)
            return default if value is None else value.decode("utf-8", "replace").strip()

        def flag(name: str) -> bool:
            value = (text(name, "false") or "false").lower()
            if value not in ("true", "false", "1", "0"):
                raise _bad(f"'{name}' must be true or false", name)
            return value in ("true", "1")

        served = self.models.resolve(text("model") or None)
        if "file" not in fields:
            raise _bad("file: Field required", "file")
        fmt = text("response_format", "json") or "json"
        stream = flag("stream")
        if fmt not in FORMATS[:4]:
            raise _bad(
                "Currently only support response_format: `text`, `json`, `verbose_json` or "
                "`diarized_json`"
            )
        if fmt == "diarized_json":
            raise _bad(f"Currently do not support diarized_json for {served.name}")
        if fmt == "verbose_json" and stream:
            raise _bad("verbose_json format doesn't support streaming case")
        language = text("language") or "en"
        if len(language) > 16:
            raise _bad("'language' is not a language code", "language")
        audio = read_wav(fields["file"])
        prompt = audio_prompt(audio, task, language)
        spoken = max(1, math.ceil(audio.duration_s * SPOKEN_TOKENS_PER_S))
        limit = text("max_completion_tokens")
        if limit is not None:
            if not limit.isdigit():
                raise _bad("max_completion_tokens must be a positive integer")
            spoken = min(spoken, positive_int(int(limit), "max_completion_tokens"))
        ident = f"{task}-{self.new_id()}"
        if stream:
            await self._stream(
                task, ident, prompt, spoken, served, flag("stream_include_usage"), send
            )
            return
        async with self.generator.run(prompt, spoken, served) as tokens:
            outputs = [event.token async for event in tokens]
        words = "".join(detokenize(t) for t in outputs).strip()
        doc: Json = {"text": words}
        if fmt == "verbose_json":
            doc = {
                "duration": audio.duration_s,
                "language": language,
                "text": words,
                "segments": [
                    {
                        "id": 0,
                        "avg_logprob": -0.25,
                        "compression_ratio": 1.0,
                        "end": audio.duration_s,
                        "no_speech_prob": 0.0,
                        "seek": 0,
                        "start": 0.0,
                        "temperature": 0.0,
                        "text": words,
                        "tokens": outputs,
                    }
                ],
                "words": None,
            }
        elif task == "transcribe":
            doc["usage"] = {"type": "duration", "seconds": math.ceil(audio.duration_s)}
        await send_json(send, doc)

    async def _stream(
        self,
        task: str,
        ident: str,
        prompt: list[int],
        max_tokens: int,
        served: Served,
        include_usage: bool,
        send: Send,
    ) -> None:
        obj = "transcription.chunk" if task == "transcribe" else "translation.chunk"
        created = int(self.wall_clock())
        count = 0
        async with self.generator.run(prompt, max_tokens, served) as tokens:
            await start_sse(send)
            async for event in tokens:
                piece = detokenize(event.token)
                if not count:
                    piece = piece.lstrip()
                count += 1
                choice: Json = {"delta": {"content": piece}}
                if event.finish_reason is not None:
                    choice.update(finish_reason=event.finish_reason, stop_reason=None)
                chunk = {
                    "id": ident,
                    "object": obj,
                    "created": created,
                    "model": served.name,
                    "choices": [choice],
                }
                await send_chunk(send, sse_data(chunk))
        if include_usage:
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": count,
                "total_tokens": len(prompt) + count,
            }
            chunk = {
                "id": ident,
                "object": obj,
                "created": created,
                "model": served.name,
                "choices": [],
                "usage": usage,
            }
            await send_chunk(send, sse_data(chunk))
        await send_chunk(send, b"data: [DONE]\n\n", last=True)
