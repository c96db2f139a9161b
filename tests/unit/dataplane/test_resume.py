"""Resuming a broken stream, the pure part: what the client received, the continuation request,
and the splice of the continuation's events into the client's stream (no sockets)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.dataplane.resume import (
    MAX_TRANSCRIPT_BYTES,
    Delivered,
    Splicer,
    Transcript,
    TranscriptBudget,
    continuation,
    not_resumable,
    read_delivered,
)

WORDS = [" alpha", " beta", " gamma", " delta", " epsilon", " zeta"]


def event(doc: dict[str, Any] | str) -> bytes:
    data = doc.encode() if isinstance(doc, str) else orjson.dumps(doc)
    return b"data: " + data + b"\n\n"


def chat_chunk(ident: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    return event(
        {
            "id": ident,
            "object": "chat.completion.chunk",
            "created": 1700,
            "model": "m1",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
    )


def chat_stream(ident: str, words: list[str], *, finish: bool, usage: tuple[int, int] | None):
    """An engine's chat stream: role chunk, one chunk per token, then the end."""
    out = [chat_chunk(ident, {"role": "assistant", "content": ""})]
    for i, word in enumerate(words):
        last = finish and i == len(words) - 1
        out.append(chat_chunk(ident, {"content": word}, "length" if last else None))
    if usage is not None:
        prompt, completion = usage
        doc = {
            "id": ident,
            "object": "chat.completion.chunk",
            "created": 1800,
            "model": "m1",
            "choices": [],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }
        out.append(event(doc))
    if finish:
        out.append(b"data: [DONE]\n\n")
    return out


def delivered_of(pieces: list[bytes], kind: str = "chat") -> Delivered:
    got = read_delivered(pieces, kind)
    assert isinstance(got, Delivered), got
    return got


# -- what may be resumed --------------------------------------------------------------------------


def test_an_ordinary_chat_or_completion_may_be_resumed() -> None:
    assert not_resumable("chat", {"messages": [], "max_tokens": 5}, None) == ""
    assert not_resumable("completions", {"prompt": "once", "max_tokens": 5}, None) == ""
    assert not_resumable("completions", {"prompt": ["once"]}, None) == ""


@pytest.mark.parametrize(
    ("kind", "doc", "header", "why"),
    [
        ("chat", {"messages": []}, b"off", "turned off"),
        ("chat", {"messages": []}, b" OFF ", "turned off"),
        ("chat", {"messages": [], "n": 2}, None, "several choices"),
        ("chat", {"messages": [], "logprobs": True}, None, "logprobs"),
        ("chat", {"messages": [], "response_format": {"type": "json_object"}}, None, "structured"),
        ("chat", {"messages": [], "guided_json": {}}, None, "structured"),
        ("chat", {"prompt": "x"}, None, "no messages"),
        ("completions", {"prompt": [1, 2, 3]}, None, "not one string"),
        ("completions", {"prompt": "x", "echo": True}, None, "echo"),
        ("completions", {"prompt": "x", "best_of": 3}, None, "several choices"),
        ("embeddings", {"input": "x"}, None, "not a chat"),
        ("chat", None, None, "not a chat"),
    ],
)
def test_what_cannot_be_resumed_faithfully_says_why(
    kind: str, doc: dict[str, Any] | None, header: bytes | None, why: str
) -> None:
    assert why in not_resumable(kind, doc, header)


# -- reading back what the client got ------------------------------------------------------------


def test_the_delivered_text_id_and_token_count_are_read_back() -> None:
    got = delivered_of(chat_stream("chatcmpl-1", WORDS[:3], finish=False, usage=None))
    assert (got.ident, got.created, got.model) == ("chatcmpl-1", 1700, "m1")
    assert got.text == " alpha beta gamma" and got.tokens == 3


def test_a_text_completion_is_read_back() -> None:
    pieces = [
        event({"id": "cmpl-9", "object": "text_completion", "created": 5, "model": "m1",
               "choices": [{"index": 0, "text": w, "logprobs": None, "finish_reason": None}]})
        for w in WORDS[:2]
    ]  # fmt: skip
    got = delivered_of(pieces, "completions")
    assert got.text == " alpha beta" and got.tokens == 2 and got.ident == "cmpl-9"


@pytest.mark.parametrize(
    ("pieces", "why"),
    [
        ([chat_chunk("c", {"content": " a"})[:-1]], "inside an event"),
        (chat_stream("c", WORDS[:2], finish=True, usage=None), "finished"),
        ([chat_chunk("c", {"content": " a"}), b"data: [DONE]\n\n"], "ended"),
        ([chat_chunk("c", {"content": " a"}, "stop")], "finished"),
        ([chat_chunk("c", {"tool_calls": [{"index": 0}]})], "tool call"),
        ([chat_chunk("c", {"reasoning_content": "hmm"})], "reasoning"),
        ([event({"error": {"message": "x"}})], "error"),
        ([b"data: {not json\n\n"], "not JSON"),
        ([event({"choices": [{"index": 0, "delta": {"content": " a"}}]})], "without an id"),
        (
            [event({"id": "c", "choices": [{"index": 0, "delta": {}}, {"index": 1, "delta": {}}]})],
            "several choices",
        ),
    ],
)
def test_a_transcript_that_cannot_be_continued_says_why(pieces: list[bytes], why: str) -> None:
    got = read_delivered(pieces, "chat")
    assert isinstance(got, str) and why in got


@pytest.mark.parametrize("pieces", [[], [b""], [b": keep-alive comment\n\n"]])
def test_a_stream_that_broke_before_its_first_event_is_sent_again_whole(
    pieces: list[bytes],
) -> None:
    """The node sent its head and died: the client holds nothing of the answer, so the request
    goes to another node as it came, and that node's stream reaches the client unchanged."""
    doc = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
           "stream": True}  # fmt: skip
    got = read_delivered(pieces, "chat")
    assert isinstance(got, Delivered) and got.ident is None and got.tokens == 0
    body = continuation("chat", doc, got)
    assert isinstance(body, bytes) and orjson.loads(body) == doc
    stream = chat_stream("new-1", WORDS[:3], finish=True, usage=(7, 3))
    spliced = Splicer(got, "chat").feed(stream)
    assert spliced == stream, "the role chunk, ids and usage of the new node, as they came"


def test_crlf_framed_events_are_read_too() -> None:
    pieces = [
        p.replace(b"\n", b"\r\n") for p in chat_stream("c", WORDS[:2], finish=False, usage=None)
    ]
    assert delivered_of(pieces).text == " alpha beta"


# -- the continuation request ---------------------------------------------------------------------


def test_a_chat_continuation_carries_the_partial_answer_and_the_tokens_left() -> None:
    doc = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
           "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    got = delivered_of(chat_stream("c", WORDS[:4], finish=False, usage=None))
    body = continuation("chat", doc, got)
    assert isinstance(body, bytes)
    new = orjson.loads(body)
    assert new["messages"][-1] == {"role": "assistant", "content": " alpha beta gamma delta"}
    assert new["messages"][:-1] == doc["messages"]
    assert new["continue_final_message"] is True and new["add_generation_prompt"] is False
    assert new["max_tokens"] == 6 and new["stream_options"] == {"include_usage": True}
    assert doc["messages"] == [{"role": "user", "content": "hi"}], "the original is untouched"


def test_a_completion_continuation_extends_the_prompt() -> None:
    got = Delivered()
    got.text, got.tokens = " alpha beta", 2
    new = orjson.loads(continuation("completions", {"prompt": ["Once"], "max_tokens": 3}, got))
    assert new["prompt"] == "Once alpha beta" and new["max_tokens"] == 1


def test_max_completion_tokens_is_reduced_too_and_nothing_left_is_no_continuation() -> None:
    got = Delivered()
    got.tokens = 4
    new = orjson.loads(continuation("chat", {"messages": [], "max_completion_tokens": 9}, got))
    assert new["max_completion_tokens"] == 5
    assert continuation("chat", {"messages": [], "max_tokens": 4}, got) == (
        "no tokens left to generate"
    )


# -- the splice -----------------------------------------------------------------------------------


def spliced_events(splicer: Splicer, pieces: list[bytes]) -> list[Any]:
    out = b"".join(splicer.feed(pieces))
    return [
        "[DONE]" if e == b"data: [DONE]" else orjson.loads(e[6:]) for e in out.split(b"\n\n") if e
    ]


def test_the_continuation_speaks_as_the_original_stream_with_whole_answer_usage() -> None:
    first = chat_stream("chatcmpl-first", WORDS[:2], finish=False, usage=None)
    got = delivered_of(first)
    # The continuation re-read the 2 delivered tokens as prompt: 12 + 2, and wrote 3 more.
    second = chat_stream("chatcmpl-second", WORDS[2:5], finish=True, usage=(14, 3))
    splicer = Splicer(got, "chat")
    events = spliced_events(splicer, second)
    assert events[-1] == "[DONE]"
    docs = events[:-1]
    assert all(d["id"] == "chatcmpl-first" and d["created"] == 1700 for d in docs)
    assert all("role" not in c["delta"] for d in docs for c in d["choices"]), "one role chunk"
    contents = [c["delta"]["content"] for d in docs for c in d["choices"]]
    assert contents == [" gamma", " delta", " epsilon"]
    assert [c["finish_reason"] for d in docs for c in d["choices"]][-1] == "length"
    assert docs[-1]["usage"] == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    assert splicer.tokens == 3


@given(st.lists(st.integers(min_value=1, max_value=4000), max_size=12))
def test_the_splice_does_not_depend_on_how_the_bytes_were_split(cuts: list[int]) -> None:
    got = delivered_of(chat_stream("a", WORDS[:1], finish=False, usage=None))
    whole = b"".join(chat_stream("b", WORDS[1:], finish=True, usage=(9, 5)))
    at = sorted({c % (len(whole) + 1) for c in cuts})
    parts = [whole[i:j] for i, j in zip([0, *at], [*at, len(whole)], strict=True)]
    reference = b"".join(Splicer(got, "chat").feed([whole]))
    splicer = Splicer(got, "chat")
    assert b"".join(b"".join(splicer.feed([part])) for part in parts) == reference


# -- bounded transcripts --------------------------------------------------------------------------


def test_a_transcript_keeps_bytes_within_both_budgets_and_gives_them_back() -> None:
    budget = TranscriptBudget(100)
    one, two = Transcript(budget), Transcript(budget)
    one.add([b"x" * 60])
    assert budget.used == 60 and not one.full
    two.add([b"y" * 50])  # would pass the agent's budget
    assert two.full and budget.used == 60 and two.pieces == []
    two.add([b"z"])
    assert two.pieces == [], "a dropped transcript stays dropped"
    one.release()
    assert budget.used == 0


def test_a_stream_longer_than_the_per_stream_limit_is_dropped() -> None:
    budget = TranscriptBudget(10 * MAX_TRANSCRIPT_BYTES)
    t = Transcript(budget)
    t.add([b"x" * MAX_TRANSCRIPT_BYTES])
    t.add([b"x"])
    assert t.full and budget.used == 0
