"""The simulated engine's API beyond chat, end to end on real sockets: the Responses API and
audio through the official ``openai`` SDK, Anthropic Messages through the ``anthropic`` SDK,
the pooling family, the tokenizer and LoRA adapters through httpx."""

from __future__ import annotations

import io
import json
import math
import struct
import time
import warnings
import wave
from typing import Any

import httpx
import pytest

from fabricnode.simengine.model import detokenize
from tests.system.test_simengine_server import MODEL, engine, metric

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow


def wav_bytes(seconds: float, freq: float = 440.0, rate: int = 8000) -> bytes:
    """A mono 16-bit PCM WAV of a sine tone."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        frames = b"".join(
            struct.pack("<h", int(12000 * math.sin(2 * math.pi * freq * i / rate)))
            for i in range(int(seconds * rate))
        )
        w.writeframes(frames)
    return buf.getvalue()


def named_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """``(event, data)`` pairs of a stream of named server-sent events."""
    events: list[tuple[str, dict[str, Any]]] = []
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            assert name is not None, line
            events.append((name, json.loads(line[len("data: ") :])))
            name = None
    return events


# -- Responses --------------------------------------------------------------------------------


def test_responses_create_retrieve_and_continue_with_the_openai_sdk() -> None:
    with engine("--speed", "100") as e, e.client() as c:
        client = openai.OpenAI(base_url=e.url + "/v1", api_key="sk-none")
        first = client.responses.create(
            model=MODEL, input="tell me a story", instructions="be brief", max_output_tokens=6
        )
        assert first.id.startswith("resp_") and first.object == "response"
        # The engine has no end of sequence: like vLLM at max_output_tokens, incomplete.
        assert first.status == "incomplete"
        assert first.incomplete_details is not None
        assert first.incomplete_details.reason == "max_output_tokens"
        assert len(first.output_text.split()) == 6
        assert first.output[0].type == "message" and first.output[0].role == "assistant"
        assert first.usage is not None and first.usage.output_tokens == 6
        assert first.usage.total_tokens == first.usage.input_tokens + 6
        system_user = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "tell me a story"},
        ]
        counted = c.post("/tokenize", json={"messages": system_user}).json()["count"]
        assert first.usage.input_tokens == counted  # the chat prompt, as /tokenize counts it

        again = client.responses.retrieve(first.id)
        assert again.id == first.id and again.output_text == first.output_text

        follow = client.responses.create(
            model=MODEL, input="and then?", previous_response_id=first.id, max_output_tokens=3
        )
        assert follow.previous_response_id == first.id
        # The stored conversation (not its instructions) and its answer come first.
        history = [
            {"role": "user", "content": "tell me a story"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and then?"},
        ]
        counted = c.post("/tokenize", json={"messages": history}).json()["count"]
        assert follow.usage is not None and follow.usage.input_tokens == counted

        # A response asked not to be stored cannot be retrieved nor continued.
        unstored = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=1)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unstored.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=MODEL, input="y", previous_response_id=unstored.id)


def test_responses_stream_sends_vllms_event_sequence() -> None:
    with engine("--speed", "50") as e:
        client = openai.OpenAI(base_url=e.url + "/v1", api_key="sk-none")
        plain = client.responses.create(model=MODEL, input="stream this", max_output_tokens=5)
        events = list(
            client.responses.create(
                model=MODEL, input="stream this", max_output_tokens=5, stream=True
            )
        )
        types = [ev.type for ev in events]
        assert types == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            *["response.output_text.delta"] * 5,
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert [ev.sequence_number for ev in events] == list(range(len(events)))
        text = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
        assert text == plain.output_text
        done = events[-1].response
        assert done.output_text == text and done.usage is not None
        assert done.usage.output_tokens == 5
        assert client.responses.retrieve(done.id).output_text == text  # stored


def test_responses_request_id_names_the_response_and_unknown_ids_are_404() -> None:
    with engine("--speed", "100") as e, e.client() as c:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "request_id": "resp_node7_x"}
        created = c.post("/v1/responses", json=body)
        assert created.status_code == 200 and created.json()["id"] == "resp_node7_x"
        assert c.get("/v1/responses/resp_node7_x").json()["id"] == "resp_node7_x"
        missing = c.get("/v1/responses/resp_nope")
        assert missing.status_code == 404
        assert missing.json() == {
            "error": {
                "message": "Response with id 'resp_nope' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": 404,
            }
        }
        assert c.post("/v1/responses/resp_nope/cancel").status_code == 404
        # A finished response is not cancellable (vLLM: only background ones are).
        refused = c.post("/v1/responses/resp_node7_x/cancel")
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == "Cannot cancel a synchronous response."
        assert c.post("/v1/responses", json={"model": "other", "input": "x"}).status_code == 404
        assert c.post("/v1/responses", json={"input": 5}).status_code == 400
        assert c.get("/v1/responses/a/b").status_code == 404
        assert c.post("/v1/responses/resp_node7_x").status_code == 405


def test_a_cancelled_background_response_frees_the_engine() -> None:
    with engine("--speed", "0.2") as e, e.client() as c:
        body = {"model": MODEL, "input": "long", "max_output_tokens": 2000, "background": True}
        queued = c.post("/v1/responses", json=body).json()
        assert queued["status"] == "queued" and queued["background"] is True
        rid = queued["id"]
        deadline = time.monotonic() + 5
        while metric(c.get("/metrics").text, "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert c.get(f"/v1/responses/{rid}").json()["status"] == "in_progress"
        cancelled = c.post(f"/v1/responses/{rid}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        deadline = time.monotonic() + 5
        while metric(c.get("/metrics").text, "vllm:num_requests_running") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert c.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
        assert c.post(f"/v1/responses/{rid}/cancel").status_code == 400
        # Background needs store, as in vLLM.
        refused = c.post("/v1/responses", json={**body, "store": False})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "background"


def test_a_background_response_completes_and_is_retrievable() -> None:
    with engine("--speed", "100") as e, e.client() as c:
        body = {"input": "later", "max_output_tokens": 4, "background": True}
        rid = c.post("/v1/responses", json=body).json()["id"]
        deadline = time.monotonic() + 5
        while (doc := c.get(f"/v1/responses/{rid}").json())["status"] in ("queued", "in_progress"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert doc["status"] == "incomplete" and doc["usage"]["output_tokens"] == 4
        assert len(doc["output"][0]["content"][0]["text"].split()) == 4


# -- Anthropic Messages -----------------------------------------------------------------------


def test_anthropic_messages_plain_streamed_and_counted_with_the_anthropic_sdk() -> None:
    with engine("--speed", "50") as e:
        client = anthropic.Anthropic(base_url=e.url, api_key="sk-none")
        messages = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
        reply = client.messages.create(
            model=MODEL, max_tokens=7, system="you are terse", messages=messages
        )
        assert reply.id.startswith("msg_") and reply.type == "message"
        assert reply.role == "assistant" and reply.model == MODEL
        assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None
        assert reply.content[0].type == "text" and len(reply.content[0].text.split()) == 7
        assert reply.usage.output_tokens == 7

        with client.messages.stream(
            model=MODEL, max_tokens=7, system="you are terse", messages=messages
        ) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert streamed == reply.content[0].text
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 7

        counted = client.messages.count_tokens(
            model=MODEL, system="you are terse", messages=messages
        )
        assert counted.input_tokens == reply.usage.input_tokens

        with pytest.raises(anthropic.NotFoundError):
            client.messages.create(model="no-such-model", max_tokens=2, messages=messages)


def test_anthropic_stream_event_names_and_error_shape() -> None:
    with engine("--speed", "100") as e, e.client() as c:
        body = {
            "model": MODEL,
            "max_tokens": 3,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        with c.stream("POST", "/v1/messages", json=body) as response:
            events = named_events(response)
        names = [name for name, _ in events]
        assert names == [
            "message_start",
            "content_block_start",
            "ping",
            *["content_block_delta"] * 3,
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        assert all(data["type"] == name for name, data in events)
        assert events[3][1]["delta"]["type"] == "text_delta"
        delta = events[-2][1]
        assert delta["delta"]["stop_reason"] == "max_tokens"
        assert delta["usage"]["output_tokens"] == 3
        missing = c.post("/v1/messages", json={"model": MODEL, "messages": body["messages"]})
        assert missing.status_code == 400
        assert missing.json()["type"] == "error" and missing.json()["error"]["message"]
        bad_json = c.post("/v1/messages", content=b"{nope")
        assert bad_json.status_code == 400 and bad_json.json()["type"] == "error"


# -- pooling and tokenizer --------------------------------------------------------------------


def test_rerank_score_pooling_and_classify() -> None:
    docs = ["a green pear", "the red apple pie", "an apple", "nothing here"]
    with engine("--speed", "100") as e, e.client() as c:
        before = metric(c.get("/metrics").text, "vllm:prompt_tokens_total")
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r = c.post(path, json={"model": MODEL, "query": "red apple", "documents": docs})
            assert r.status_code == 200, r.text
            doc = r.json()
            assert doc["id"].startswith("score-") and doc["model"] == MODEL
            assert [x["index"] for x in doc["results"]] == [1, 2, 0, 3]
            scores = [x["relevance_score"] for x in doc["results"]]
            assert scores == sorted(scores, reverse=True) and scores[-1] == 0.0
            assert doc["results"][0]["document"]["text"] == docs[1]
        # Each pair ran through the engine as a prefill.
        after = metric(c.get("/metrics").text, "vllm:prompt_tokens_total")
        assert after - before == 3 * doc["usage"]["prompt_tokens"]
        top = c.post("/rerank", json={"query": "red apple", "documents": docs, "top_n": 2})
        assert [x["index"] for x in top.json()["results"]] == [1, 2]

        forms = [
            {"text_1": "red apple", "text_2": docs},
            {"queries": "red apple", "documents": docs},
            {"queries": ["red apple"] * 4, "items": docs},
            {"data_1": "red apple", "data_2": docs},
        ]
        results = []
        for form in forms:
            r = c.post("/score", json={"model": MODEL, **form})
            assert r.status_code == 200, r.text
            assert r.json()["object"] == "list"
            results.append([(d["index"], d["object"], d["score"]) for d in r.json()["data"]])
        assert all(r == results[0] for r in results)
        assert [s for _, _, s in results[0]] == [
            x["relevance_score"] for x in sorted(doc["results"], key=lambda x: x["index"])
        ]
        assert c.post("/v1/score", json=forms[0]).status_code == 200
        uneven = c.post("/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
        assert uneven.status_code == 400
        assert uneven.json()["error"]["message"] == "Input lengths must be either 1:1, 1:N or N:N"

        pooled = c.post("/pooling", json={"model": MODEL, "input": ["x", "y z"]}).json()
        assert pooled["object"] == "list" and [d["index"] for d in pooled["data"]] == [0, 1]
        emb = c.post("/v1/embeddings", json={"input": ["x"]}).json()
        assert pooled["data"][0]["data"] == emb["data"][0]["embedding"]  # the same vector
        tokens = c.post("/pooling", json={"input": "y z", "task": "token_embed"}).json()
        assert len(tokens["data"][0]["data"]) == 2
        assert c.post("/pooling", json={"input": "x", "task": "generate"}).status_code == 400

        cls = c.post("/classify", json={"model": MODEL, "input": ["good", "bad"]}).json()
        assert cls["id"].startswith("classify-")
        for item in cls["data"]:
            assert item["num_classes"] == 2 and abs(sum(item["probs"]) - 1.0) < 1e-9
            assert item["label"] in ("LABEL_0", "LABEL_1")
        again = c.post("/classify", json={"input": ["good", "bad"]}).json()
        assert again["data"] == cls["data"]


def test_tokenize_counts_what_usage_reports_and_detokenize_uses_the_output_vocabulary() -> None:
    with engine("--speed", "100", "--max-model-len", "2048") as e, e.client() as c:
        prompt = "Hello, world: the tokenizer!"
        tok = c.post(
            "/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True}
        )
        assert tok.status_code == 200
        doc = tok.json()
        assert doc["max_model_len"] == 2048 and doc["count"] == len(doc["tokens"])
        assert doc["token_strs"] == ["Hello", ",", "world", ":", "the", "tokenizer", "!"]
        comp = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
        assert comp["usage"]["prompt_tokens"] == doc["count"]
        messages = [{"role": "user", "content": prompt}]
        chat = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
        counted = c.post("/tokenize", json={"messages": messages}).json()
        assert counted["count"] == chat["usage"]["prompt_tokens"]
        assert counted["token_strs"] is None

        ids = [5, 17, 31999]
        detok = c.post("/detokenize", json={"model": MODEL, "tokens": ids})
        assert detok.json() == {"prompt": "".join(detokenize(t) for t in ids)}
        assert c.post("/detokenize", json={"tokens": [32000]}).status_code == 400
        assert c.post("/detokenize", json={"tokens": ["a"]}).status_code == 400
        assert c.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


# -- audio ------------------------------------------------------------------------------------


def test_transcriptions_and_translations_with_the_openai_sdk() -> None:
    one, two = wav_bytes(2.0), wav_bytes(2.0, freq=880.0)
    with engine("--speed", "100") as e, e.client() as c:
        client = openai.OpenAI(base_url=e.url + "/v1", api_key="sk-none")
        first = client.audio.transcriptions.create(model=MODEL, file=("a.wav", one))
        again = client.audio.transcriptions.create(model=MODEL, file=("a.wav", one))
        other = client.audio.transcriptions.create(model=MODEL, file=("b.wav", two))
        assert first.text and first.text == again.text and first.text != other.text
        assert len(first.text.split()) == 5  # 2.5 spoken tokens a second
        raw = c.post(
            "/v1/audio/transcriptions", files={"file": ("a.wav", one)}, data={"model": MODEL}
        ).json()
        assert raw == {"text": first.text, "usage": {"type": "duration", "seconds": 2}}
        verbose = c.post(
            "/v1/audio/transcriptions",
            files={"file": ("a.wav", one)},
            data={"response_format": "verbose_json", "language": "de"},
        ).json()
        assert verbose["duration"] == 2.0 and verbose["language"] == "de"
        assert verbose["segments"][0]["end"] == 2.0
        with warnings.catch_warnings():  # the SDK marks translations deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            translated = client.audio.translations.create(model=MODEL, file=("a.wav", one))
        assert translated.text and translated.text != first.text
        assert (
            "usage" not in c.post("/v1/audio/translations", files={"file": ("a.wav", one)}).json()
        )

        data = {"stream": "true", "stream_include_usage": "true"}
        with c.stream(
            "POST", "/v1/audio/transcriptions", files={"file": ("a.wav", one)}, data=data
        ) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
        assert all(ch["object"] == "transcription.chunk" for ch in chunks)
        text = "".join(ch["choices"][0]["delta"]["content"] for ch in chunks if ch["choices"])
        assert text == first.text
        assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_bad_audio_uploads_are_400() -> None:
    with engine("--speed", "100") as e, e.client(timeout=30) as c:
        path = "/v1/audio/transcriptions"
        not_wav = c.post(path, files={"file": ("a.mp3", b"ID3 not a wave file at all")})
        assert not_wav.status_code == 400 and "audio file" in not_wav.json()["error"]["message"]
        truncated = c.post(path, files={"file": ("a.wav", wav_bytes(1.0)[:30])})
        assert truncated.status_code == 400
        assert c.post(path, data={"model": MODEL}).status_code == 400  # no file
        assert c.post(path, json={"file": "x"}).status_code == 400  # not multipart
        cut = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF'
        malformed = c.post(
            path, content=cut, headers={"content-type": "multipart/form-data; boundary=b"}
        )
        assert malformed.status_code == 400
        fmt = c.post(
            path, files={"file": ("a.wav", wav_bytes(0.5))}, data={"response_format": "srt"}
        )
        assert fmt.status_code == 400
        big = c.post(path, files={"file": ("big.wav", b"\0" * (26 * 1024 * 1024))})
        assert big.status_code == 400
        assert big.json()["error"]["message"] == "Maximum file size exceeded"
        assert c.get("/health").status_code == 200


# -- LoRA -------------------------------------------------------------------------------------


def test_lora_adapters_are_listed_served_loaded_and_unloaded() -> None:
    flags = ("--speed", "100", "--enable-lora", "--lora-modules", "sql=/adapters/sql")
    with engine(*flags) as e, e.client() as c:
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert cards["sql"]["parent"] == MODEL and cards["sql"]["root"] == "/adapters/sql"
        assert cards[MODEL]["parent"] is None

        def chat(model: str) -> dict[str, Any]:
            body = {"model": model, "messages": [{"role": "user", "content": "q"}], "max_tokens": 6}
            return c.post("/v1/chat/completions", json=body).json()

        base, tuned = chat(MODEL), chat("sql")
        assert tuned["model"] == "sql" and base["model"] == MODEL
        text = tuned["choices"][0]["message"]["content"]
        assert text != base["choices"][0]["message"]["content"]  # the adapter was applied
        assert chat("sql")["choices"][0]["message"]["content"] == text  # deterministically

        load = c.post("/v1/load_lora_adapter", json={"lora_name": "chat2", "lora_path": "/a/c"})
        assert load.status_code == 200
        assert load.text == "Success: LoRA adapter 'chat2' added successfully."
        assert "chat2" in {m["id"] for m in c.get("/v1/models").json()["data"]}
        client = anthropic.Anthropic(base_url=e.url, api_key="sk-none")
        reply = client.messages.create(
            model="chat2", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.model == "chat2"
        again = c.post("/v1/load_lora_adapter", json={"lora_name": "chat2", "lora_path": "/a/c"})
        assert (
            again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        )
        inplace = {"lora_name": "chat2", "lora_path": "/a/d", "load_inplace": True}
        assert c.post("/v1/load_lora_adapter", json=inplace).status_code == 200
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400
        base_name = {"lora_name": MODEL, "lora_path": "/p"}
        assert c.post("/v1/load_lora_adapter", json=base_name).status_code == 400

        unload = c.post("/v1/unload_lora_adapter", json={"lora_name": "chat2"})
        assert unload.status_code == 200
        assert unload.text == "Success: LoRA adapter 'chat2' removed successfully."
        gone = c.post("/v1/unload_lora_adapter", json={"lora_name": "chat2"})
        assert gone.status_code == 404
        assert chat("chat2")["error"]["code"] == "model_not_found"


def test_without_enable_lora_there_are_no_adapter_endpoints() -> None:
    with engine("--speed", "100") as e, e.client() as c:
        body = {"lora_name": "a", "lora_path": "/a"}
        assert c.post("/v1/load_lora_adapter", json=body).status_code == 404
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [MODEL]


def test_ping_version_and_health() -> None:
    with engine("--speed", "100") as e, e.client() as c:
        assert c.get("/ping").status_code == 200
        assert c.post("/ping").status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/version").json()["version"].startswith("fabricnode-sim")


def test_new_inference_endpoints_are_refused_while_asleep() -> None:
    with engine("--speed", "100", "--wake-up-s", "0") as e, e.client() as c:
        assert c.post("/sleep").status_code == 200
        asleep = c.post("/v1/responses", json={"input": "x"})
        assert asleep.status_code == 503 and asleep.json()["error"]["code"] == "model_sleeping"
        messages = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        refused = c.post("/v1/messages", json=messages)
        assert refused.status_code == 503 and refused.json()["type"] == "error"
        assert c.post("/rerank", json={"query": "a", "documents": ["a"]}).status_code == 503
        assert c.post("/tokenize", json={"prompt": "a"}).status_code == 200  # no engine needed
