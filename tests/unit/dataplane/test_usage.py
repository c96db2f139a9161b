"""Token usage at the ingress: usage from bodies and SSE streams, totals per key and model."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.dataplane.usage import (
    MAX_LINE_BYTES,
    StreamUsage,
    UsageLedger,
    audio_seconds_from_json,
    may_report_usage,
    usage_from_json,
)

PROMPT = "the secret plan is to reorganise the lab on tuesday"
ANSWER = "understood: tuesday reorganisation"


def chunk(delta: dict[str, Any], *, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        **extra,
    }


def sse(events: list[dict[str, Any]], *, eol: str = "\n", compact: bool = True) -> bytes:
    seps = (",", ":") if compact else (", ", ": ")
    body = "".join(f"data: {json.dumps(e, separators=seps)}{eol}{eol}" for e in events)
    return (body + f"data: [DONE]{eol}{eol}").encode()


USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
CONTENT = [chunk({"role": "assistant", "content": ""})] + [
    chunk({"content": piece}) for piece in ("under", 'stood "usage": {x}', "\ndata: [DONE]\n\n")
]
FINISH = chunk({}, finish="stop")
WITH_USAGE = sse([*CONTENT, FINISH, {"id": "chatcmpl-1", "choices": [], "usage": USAGE}])
WITHOUT_USAGE = sse([*CONTENT, FINISH])


def feed_in(pieces: list[bytes]) -> tuple[int | None, int]:
    usage = StreamUsage()
    for piece in pieces:
        usage.feed(piece)
    return usage.result()


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(points)]


# -- non-streamed -----------------------------------------------------------------------------


def test_usage_from_a_chat_completion_body() -> None:
    body = {"id": "x", "choices": [{"message": {"content": ANSWER}}], "usage": USAGE}
    assert usage_from_json(json.dumps(body).encode()) == (12, 3)


def test_usage_from_an_embeddings_body_has_no_completion_tokens() -> None:
    body = {"data": [], "usage": {"prompt_tokens": 7, "total_tokens": 7}}
    assert usage_from_json(json.dumps(body).encode()) == (7, 0)


@pytest.mark.parametrize(
    "body",
    [b"", b"{}", b'{"usage": null}', b'{"usage": {"prompt_tokens": "7"}}', b'{"usage": [', b"[]"],
)
def test_bodies_without_valid_usage_give_none(body: bytes) -> None:
    assert usage_from_json(body) is None


def test_usage_from_the_other_endpoints_bodies() -> None:
    responses = {"id": "resp_1", "usage": {"input_tokens": 7, "output_tokens": 4}}
    assert usage_from_json(json.dumps(responses).encode()) == (7, 4)
    messages = {"type": "message", "usage": {"input_tokens": 9, "output_tokens": 2}}
    assert usage_from_json(json.dumps(messages).encode()) == (9, 2)
    rerank = {"results": [], "usage": {"prompt_tokens": 11, "total_tokens": 11}}
    assert usage_from_json(json.dumps(rerank).encode()) == (11, 0)
    score = {"data": [], "usage": {"prompt_tokens": 5, "completion_tokens": None}}
    assert usage_from_json(json.dumps(score).encode()) == (5, 0)
    audio = {"text": "hi", "usage": {"type": "duration", "seconds": 3}}
    assert usage_from_json(json.dumps(audio).encode()) is None
    assert audio_seconds_from_json(json.dumps(audio).encode()) == 3.0
    assert audio_seconds_from_json(json.dumps(responses).encode()) is None


def named_events(events: list[tuple[str, dict[str, Any]]]) -> bytes:
    return "".join(f"event: {name}\ndata: {json.dumps(doc)}\n\n" for name, doc in events).encode()


def test_a_responses_stream_reports_usage_in_its_completed_event() -> None:
    pending = {"id": "resp_1", "status": "in_progress", "usage": None}
    done = {**pending, "status": "completed", "usage": {"input_tokens": 7, "output_tokens": 4}}
    data = named_events(
        [
            ("response.created", {"type": "response.created", "response": pending}),
            ("response.output_text.delta", {"type": "x", "delta": "hi", "sequence_number": 2}),
            ("response.completed", {"type": "response.completed", "response": done}),
        ]
    )
    for cuts in ([], [5, 60, 200]):
        usage = StreamUsage()
        for piece in split_at(data, cuts):
            usage.feed(piece)
        assert usage.result() == (7, 4) and usage.reported
    assert usage.last_event is not None and b"response.completed" in usage.last_event


def test_a_messages_stream_takes_input_from_its_start_and_output_from_its_last_delta() -> None:
    start = {"type": "message", "usage": {"input_tokens": 9, "output_tokens": 1}}
    data = named_events(
        [
            ("message_start", {"type": "message_start", "message": start}),
            ("content_block_delta", {"type": "content_block_delta", "delta": {"text": "a"}}),
            ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 3}}),
            ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 5}}),
            ("message_stop", {"type": "message_stop"}),
        ]
    )
    assert feed_in([data]) == (9, 5)
    # A stream cut before its last delta: what was reported so far.
    assert feed_in([data.split(b"event: message_delta")[0]]) == (9, 1)


# -- streamed ---------------------------------------------------------------------------------


def test_reported_usage_wins_over_counting() -> None:
    usage = StreamUsage()
    usage.feed(WITH_USAGE)
    assert usage.result() == (12, 3)
    assert usage.reported and usage.done and not usage.error


def test_without_usage_content_events_are_counted_as_completion_tokens() -> None:
    usage = StreamUsage()
    usage.feed(WITHOUT_USAGE)
    # The role chunk (empty content) and the finish chunk carry no token.
    assert usage.result() == (None, 3)
    assert not usage.reported


def test_completions_stream_counts_text_events() -> None:
    events = [{"choices": [{"text": t, "index": 0}]} for t in ("a", "b", "")]
    assert feed_in([sse(events, compact=False)]) == (None, 2)


def test_cumulative_usage_in_every_chunk_keeps_the_last() -> None:
    events = [
        chunk({"content": "a"}, usage={"prompt_tokens": 5, "completion_tokens": 1}),
        chunk({"content": "b"}, usage={"prompt_tokens": 5, "completion_tokens": 2}),
    ]
    assert feed_in([sse(events)]) == (5, 2)


def test_only_events_that_report_usage_are_parsed() -> None:
    # Parsing every event would cost the relay a JSON parse per streamed chunk: a cheap scan
    # picks the events that can carry a usage object, and only those are parsed.
    events = [*CONTENT, *(chunk({"content": str(i)}, usage=None) for i in range(50))]
    final = {"choices": [], "usage": USAGE}
    datas = [json.dumps(e, separators=(", ", ": ")).encode() for e in [*events, final]]
    assert [d for d in datas if may_report_usage(d)] == [datas[-1]], (
        'usage: null and an escaped "usage" in content are not parsed'
    )
    assert feed_in([sse([*events, final], compact=False)]) == (12, 3)


def test_an_error_event_mid_stream_is_noticed() -> None:
    stream = sse([chunk({"content": "a"}), {"error": {"message": "engine died"}}])
    usage = StreamUsage()
    usage.feed(stream)
    assert usage.error and usage.result() == (None, 1)


def test_a_stream_cut_before_its_last_blank_line_still_counts() -> None:
    cut = WITH_USAGE[: WITH_USAGE.rindex(b"data: [DONE]")].rstrip(b"\n")
    assert feed_in([cut]) == (12, 3)
    usage = StreamUsage()
    usage.feed(cut)
    assert not usage.done


@pytest.mark.parametrize("stream", [WITH_USAGE, WITHOUT_USAGE, sse(CONTENT, eol="\r\n")])
def test_every_single_split_point_gives_the_same_answer(stream: bytes) -> None:
    expected = feed_in([stream])
    for i in range(len(stream) + 1):
        assert feed_in([stream[:i], stream[i:]]) == expected, i
    assert feed_in([stream[i : i + 1] for i in range(len(stream))]) == expected


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_split_gives_the_same_answer(data: st.DataObject) -> None:
    stream = data.draw(st.sampled_from([WITH_USAGE, WITHOUT_USAGE, sse(CONTENT, eol="\r\n")]))
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=30))
    assert feed_in(split_at(stream, cuts)) == feed_in([stream])


def test_an_overlong_line_is_dropped_not_buffered() -> None:
    usage = StreamUsage()
    usage.feed(b"data: " + b"x" * (MAX_LINE_BYTES + 10))
    usage.feed(b"yyy\n\n")
    usage.feed(sse([chunk({"content": "a"})]))
    assert usage.result() == (None, 1)


# -- totals -----------------------------------------------------------------------------------


def test_ledger_totals_per_key_and_model() -> None:
    ledger = UsageLedger()
    ledger.record("alice", "m1", 10, 5)
    ledger.record("alice", "m1", 20, None)
    ledger.record(None, "m1", None, None, error=True)
    ledger.record("alice", "m2", 1, 1)
    rows = {(r.key, r.model): r for r in ledger.snapshot()}
    alice = rows[("alice", "m1")]
    assert (alice.requests, alice.prompt_tokens, alice.completion_tokens, alice.errors) == (
        2,
        30,
        5,
        0,
    )
    assert rows[("anonymous", "m1")].errors == 1
    assert [(r.key, r.model) for r in ledger.snapshot()] == sorted(rows)


def test_ledger_is_bounded_whatever_models_clients_invent() -> None:
    ledger = UsageLedger(max_rows=5)
    for i in range(100):
        ledger.record("alice", f"made-up-{i}", 1, 1)
    rows = ledger.snapshot()
    assert len(rows) <= 6
    other = next(r for r in rows if r.model == "(other)")
    assert sum(r.requests for r in rows) == 100 and other.requests == 95
