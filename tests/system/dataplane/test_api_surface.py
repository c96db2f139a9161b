"""The API surface beyond chat, end to end: the official `openai` and `anthropic` clients talk
to real agents whose simulated engines serve Responses, Messages, embeddings and audio, through
ingresses that serve no model themselves. A Responses follow-up sent to a *different* ingress
reaches the node that stored the first answer; Anthropic's client gets its own typed errors."""

from __future__ import annotations

import io
import math
import struct
import wave
from collections.abc import Iterator

import anthropic
import openai
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from tests.support.meshview import state_is

pytestmark = pytest.mark.slow

MODEL = "m"


def tiny_wav(seconds: float = 0.5, rate: int = 8000) -> bytes:
    """A mono 16-bit PCM WAV of a 440 Hz tone."""
    frames = b"".join(
        struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / rate)))
        for i in range(int(seconds * rate))
    )
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    return out.getvalue()


@pytest.fixture
def fronts(mesh: LocalMesh) -> Iterator[tuple[AgentProcess, AgentProcess, set[str]]]:
    """Two ingresses without engines, and the session ids of two simulated nodes serving
    ``MODEL``, all SERVING in both ingresses' views."""
    front = mesh.start("front")
    back = mesh.start("back")
    nodes = [mesh.start(f"node{i}", args=["--sim", MODEL]) for i in range(2)]
    sids = {n.session_id for n in nodes}
    for ingress in (front, back):
        for sid in sids:
            assert wait_until(lambda i=ingress, s=sid: state_is(i, s, "serving"), 30)
    yield front, back, sids


def test_responses_embeddings_and_audio_with_the_openai_client(
    fronts: tuple[AgentProcess, AgentProcess, set[str]],
) -> None:
    front, back, sids = fronts
    a = openai.OpenAI(base_url=front.http_url + "/v1", api_key="unused")
    b = openai.OpenAI(base_url=back.http_url + "/v1", api_key="unused")

    raw = a.responses.with_raw_response.create(model=MODEL, input="hello", max_output_tokens=8)
    first = raw.parse()
    stored_on = raw.headers["x-fabric-node"]
    assert stored_on in sids and first.id.startswith("resp_") and first.output_text
    assert first.usage is not None and first.usage.output_tokens > 0

    # the follow-up, through the other ingress, lands where the first answer is stored
    raw = b.responses.with_raw_response.create(
        model=MODEL, input="and then?", previous_response_id=first.id, max_output_tokens=8
    )
    assert raw.headers["x-fabric-node"] == stored_on
    follow = raw.parse()
    assert follow.output_text and follow.id != first.id
    assert follow.usage is not None and follow.usage.input_tokens > first.usage.input_tokens
    again = b.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text

    events = list(a.responses.create(model=MODEL, input="stream it", stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    done = events[-1].response
    assert b.responses.retrieve(done.id).id == done.id  # a streamed answer is stored too

    vectors = a.embeddings.create(model=MODEL, input=["one", "two"])
    assert len(vectors.data) == 2 and len(vectors.data[0].embedding) > 0

    said = a.audio.transcriptions.create(model=MODEL, file=("tone.wav", tiny_wav(), "audio/wav"))
    assert said.text


def test_messages_with_the_anthropic_client_and_its_typed_errors(
    fronts: tuple[AgentProcess, AgentProcess, set[str]],
) -> None:
    front, back, _ = fronts
    client = anthropic.Anthropic(base_url=front.http_url, api_key="unused", max_retries=0)
    question = [{"role": "user", "content": "hello there"}]

    message = client.messages.create(model=MODEL, max_tokens=8, messages=question)
    assert message.type == "message" and message.content[0].type == "text"
    assert message.content[0].text and message.usage.output_tokens > 0

    with client.messages.stream(model=MODEL, max_tokens=8, messages=question) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text

    counted = client.messages.count_tokens(model=MODEL, messages=question)
    assert counted.input_tokens > 0

    other = anthropic.Anthropic(base_url=back.http_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as caught:
        other.messages.create(model="no-such-model", max_tokens=8, messages=question)
    assert "no-such-model" in str(caught.value)
