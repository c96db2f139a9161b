"""The simulated engine's API pieces that need no server: the response store's bounds, the
relevance score, multipart and WAV parsing, LoRA names and the adapter salt in the scheduler."""

from __future__ import annotations

import io
import wave

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.errors import ConfigError
from fabricnode.simengine.__main__ import main
from fabricnode.simengine.audio import audio_prompt, parse_form, read_wav
from fabricnode.simengine.httpio import HttpError
from fabricnode.simengine.lora import Models, parse_lora_module
from fabricnode.simengine.model import EngineConfig, Scheduler, adapter_salt, run_until_idle
from fabricnode.simengine.pooling import relevance
from fabricnode.simengine.responses import ResponseStore


def response(rid: str, text: str = "x") -> dict[str, object]:
    return {"id": rid, "output": [{"type": "message", "content": [{"text": text}]}]}


def test_response_store_evicts_the_oldest_past_its_count() -> None:
    store = ResponseStore(max_responses=3, max_bytes=1 << 20)
    for i in range(5):
        assert store.put(response(f"r{i}"), [{"role": "user", "content": "hi"}])
    assert len(store) == 3
    assert store.get("r0") is None and store.get("r1") is None
    assert store.get("r4") is not None
    assert store.statistics().evicted == 2


def test_response_store_evicts_the_oldest_past_its_bytes_and_refuses_a_giant() -> None:
    store = ResponseStore(max_responses=100, max_bytes=1000)
    for i in range(10):
        store.put(response(f"r{i}", "a" * 150), [])
    stats = store.statistics()
    assert stats.bytes <= 1000 and stats.responses < 10
    assert store.get("r9") is not None and store.get("r0") is None
    assert not store.put(response("huge", "b" * 2000), [])
    assert store.get("huge") is None and store.get("r9") is not None


def test_response_store_update_keeps_the_conversation_and_the_byte_count() -> None:
    store = ResponseStore(max_responses=10, max_bytes=10_000)
    store.put({"id": "r", "status": "queued"}, [{"role": "user", "content": "q"}])
    before = store.statistics().bytes
    store.update({"id": "r", "status": "completed", "output": []})
    entry = store.get("r")
    assert entry is not None and entry.doc["status"] == "completed"
    assert entry.messages == [{"role": "user", "content": "q"}]
    assert store.statistics().bytes > before
    store.update({"id": "gone"})  # evicted meanwhile: nothing happens
    assert store.get("gone") is None


@given(st.text(max_size=40), st.text(max_size=40))
def test_relevance_is_symmetric_and_bounded(a: str, b: str) -> None:
    score = relevance(a, b)
    assert 0.0 <= score <= 1.0
    assert score == relevance(b, a)


def test_relevance_ranks_shared_words_higher() -> None:
    assert relevance("Red apple", "the red apple") > relevance("red apple", "an apple") > 0
    assert relevance("red apple", "red apple") == 1.0
    assert relevance("red", "blue") == 0.0 == relevance("", "")


def wav(seconds: float, rate: int = 8000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x01\x00\x02\x00" * int(seconds * rate))
    return buf.getvalue()


def form(*parts: tuple[str, str | None, bytes], boundary: str = "XyZ") -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        out += data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


CT = "multipart/form-data; boundary=XyZ"


def test_parse_form_reads_fields_and_files() -> None:
    body = form(
        ("model", None, b"m"), ("file", "a.wav", b"RIFF....data"), ("stream", None, b"true")
    )
    fields = parse_form(body, CT, 1 << 20)
    assert fields == {"model": b"m", "file": b"RIFF....data", "stream": b"true"}


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        (form(("file", "a.wav", b"x")), "application/json", "multipart/form-data"),
        (form(("file", "a.wav", b"x")), "multipart/form-data", "multipart/form-data"),
        (form(("file", "a.wav", b"x"))[:-10], CT, "closing boundary"),
        (b"garbage without a boundary", CT, "malformed multipart"),
        (form(("file", "a.wav", b"x" * 101)), CT, "Maximum file size exceeded"),
        (form(("model", None, b"m" * 20_000)), CT, "too long"),
    ],
)
def test_parse_form_refuses_what_is_not_a_bounded_form(
    body: bytes, content_type: str, message: str
) -> None:
    with pytest.raises(HttpError) as info:
        parse_form(body, content_type, 100)
    assert info.value.status == 400 and message in info.value.message


def test_read_wav_measures_the_audio_and_refuses_other_files() -> None:
    audio = read_wav(wav(1.5))
    assert audio.duration_s == 1.5
    assert read_wav(wav(1.5)).digest == audio.digest != read_wav(wav(1.0)).digest
    for bad in (b"", b"ID3\x03 an mp3", wav(1.0)[:20]):
        with pytest.raises(HttpError) as info:
            read_wav(bad)
        assert info.value.status == 400
    # The prompt grows with the audio and depends on the task and the language.
    assert len(audio_prompt(audio, "transcribe", "en")) == 15
    assert audio_prompt(audio, "transcribe", "en") != audio_prompt(audio, "translate", "en")
    assert audio_prompt(audio, "transcribe", "en") != audio_prompt(audio, "transcribe", "de")


def test_lora_modules_parse_both_forms_and_refuse_others() -> None:
    assert parse_lora_module("sql=/p/sql") == ("sql", "/p/sql")
    assert parse_lora_module('{"name": "a", "path": "/p/a", "base_model_name": "m"}') == (
        "a",
        "/p/a",
    )
    for bad in ("sql", "=p", "a=", "{", '{"name": 1}', "[1]"):
        with pytest.raises(ConfigError):
            parse_lora_module(bad)


def test_models_resolve_adapters_and_keep_vllms_errors() -> None:
    models = Models("base", 4096, enable_lora=True, lora_modules=[("a", "/p/a")])
    assert models.resolve(None).name == "base" and models.resolve("base").salt == b""
    served = models.resolve("a")
    assert served.name == "a" and served.salt == adapter_salt("a") and served.adapter == "a"
    with pytest.raises(HttpError) as info:
        models.resolve("b")
    assert info.value.status == 404
    assert [c["id"] for c in models.cards(0)] == ["base", "a"]
    with pytest.raises(HttpError) as info:
        models.load({"lora_name": "a", "lora_path": "/q"})
    assert info.value.status == 400 and info.value.kind == "InvalidUserInput"
    models.load({"lora_name": "a", "lora_path": "/q", "load_inplace": True})
    assert models.adapters()[0].path == "/q" and models.adapters()[0].int_id == 1
    with pytest.raises(HttpError) as info:
        models.unload({"lora_name": "zz"})
    assert info.value.status == 404


def test_an_adapter_changes_the_output_and_does_not_share_kv_blocks() -> None:
    sched = Scheduler(EngineConfig("m-1b", kv_tokens=4096))
    prompt = list(range(64))  # four full blocks
    base = sched.submit(prompt, 4, 0.0)
    now = run_until_idle(sched, 0.0)
    tuned = sched.submit(prompt, 4, now, adapter_salt("sql"))
    now = run_until_idle(sched, now)
    # The base model's blocks are cached, but not for the adapter: no prefix-cache hit.
    assert sched.statistics().prefix_cache_hits == 0
    again = sched.submit(prompt, 4, now, adapter_salt("sql"))
    run_until_idle(sched, now)
    assert sched.statistics().prefix_cache_hits == 63  # all but the last token, as in vLLM
    outputs = {rid: sched.requests[rid].output for rid in (base, tuned, again)}
    assert outputs[base] != outputs[tuned] == outputs[again]


def test_lora_modules_need_enable_lora(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "m", "--lora-modules", "a=/p"]) == 2
    assert "--enable-lora" in capsys.readouterr().err
    assert main(["--model", "m", "--enable-lora", "--lora-modules", "m=/p"]) == 2
    assert "base model" in capsys.readouterr().err
