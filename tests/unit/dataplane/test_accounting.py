"""Accounting at the ingress: usage from bodies and SSE streams, totals, the request log."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode import native
from fabricnode.dataplane import accounting
from fabricnode.dataplane.accounting import (
    RequestLog,
    StreamUsage,
    TraceRecord,
    UsageLedger,
    read_request_log,
    usage_from_json,
    workload_summary,
)
from fabricnode.errors import ConfigError

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
    assert accounting.audio_seconds_from_json(json.dumps(audio).encode()) == 3.0
    assert accounting.audio_seconds_from_json(json.dumps(responses).encode()) is None


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
    assert [d for d in datas if accounting.may_report_usage(d)] == [datas[-1]], (
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
    usage.feed(b"data: " + b"x" * (accounting.MAX_LINE_BYTES + 10))
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


# -- request log ------------------------------------------------------------------------------


def record(
    t: float = 1000.0, model: str = "m", i: int | None = 10, o: int | None = 5
) -> TraceRecord:
    return TraceRecord(t=t, model=model, input_tokens=i, output_tokens=o, latency_s=1.5)


def test_request_log_holds_counts_never_prompt_or_output_text(tmp_path: Path) -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 64}
    response = {"choices": [{"message": {"content": ANSWER}}], "usage": USAGE}
    usage = usage_from_json(json.dumps(response).encode())
    assert usage is not None
    log = RequestLog(tmp_path / "log.jsonl")
    log.append(
        TraceRecord(
            t=1000.0,
            model=request["model"],  # type: ignore[arg-type]
            input_tokens=usage[0],
            output_tokens=usage[1],
            latency_s=0.8,
            ttft_s=0.1,
            status=200,
            node="ab" * 16,
            key="alice",
            stream=False,
            max_tokens=64,
        )
    )
    assert log.flush() == 1
    text = (tmp_path / "log.jsonl").read_text()
    assert PROMPT not in text and ANSWER not in text
    line = json.loads(text)
    assert set(line) == {
        "v",
        "T",
        "M",
        "I",
        "O",
        "latency_s",
        "ttft_s",
        "status",
        "node",
        "key",
        "stream",
        "max_tokens",
        "temperature",
        "endpoint",
        "tier",
    }
    assert (line["T"], line["M"], line["I"], line["O"]) == (1000.0, "m", 12, 3)
    assert not any(isinstance(v, str) and len(v) > 40 for v in line.values())


def test_client_values_smuggled_into_numeric_fields_are_not_logged(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = RequestLog(path)
    smuggled: Any = PROMPT

    def trace(**fields: Any) -> TraceRecord:
        return TraceRecord(t=1.0, model="m", output_tokens=None, latency_s=0.1, **fields)

    if native.is_compiled(accounting):
        # Compiled, the record's declared types are enforced: a string never gets in at all.
        with pytest.raises(TypeError):
            trace(input_tokens=1, max_tokens=smuggled)
        with pytest.raises(TypeError):
            trace(input_tokens=1, temperature=smuggled)
        log.append(trace(input_tokens=2**80))
    else:
        log.append(trace(input_tokens=2**80, max_tokens=smuggled, temperature=smuggled))
    assert log.flush() == 1
    text = path.read_text()
    assert PROMPT not in text
    line = json.loads(text)
    assert (line["I"], line["max_tokens"], line["temperature"]) == (None, None, None)


def test_request_log_file_is_private_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "log.jsonl"
    log = RequestLog(path)
    records = [record(t=float(i)) for i in range(5)]
    for r in records:
        assert log.append(r)
    log.flush()
    assert log.flush() == 0
    assert read_request_log(path) == records
    assert path.stat().st_mode & 0o077 == 0


def test_request_log_rotates_by_size(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    line_bytes = len(json.dumps(record().as_dict(), separators=(",", ":"))) + 1
    log = RequestLog(path, rotate_bytes=3 * line_bytes, keep=2)
    written = []
    for i in range(8):
        r = record(t=float(i))
        written.append(r)
        log.append(r)
        log.flush()
    assert path.with_name("log.jsonl.1").exists() and path.with_name("log.jsonl.2").exists()
    assert not path.with_name("log.jsonl.3").exists()
    assert path.stat().st_size <= 3 * line_bytes
    assert log.statistics().rotations == 2
    assert read_request_log(path, include_rotated=True) == written


def test_request_log_buffer_is_bounded_and_counts_drops(tmp_path: Path) -> None:
    log = RequestLog(tmp_path / "log.jsonl", max_buffer=3)
    accepted = [log.append(record(t=float(i))) for i in range(5)]
    assert accepted == [True, True, True, False, False]
    stats = log.statistics()
    assert (stats.buffered, stats.dropped) == (3, 2)
    assert log.flush() == 3
    assert log.append(record())


def test_a_failing_write_is_counted_not_raised(tmp_path: Path) -> None:
    (tmp_path / "not-a-dir").write_text("")
    log = RequestLog(tmp_path / "not-a-dir" / "log.jsonl")
    log.append(record())
    assert log.flush() == 0
    stats = log.statistics()
    assert stats.write_errors == 1 and stats.dropped == 1 and "not-a-dir" in stats.last_error


def test_appends_during_flushes_from_another_thread_are_not_lost(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = RequestLog(path, max_buffer=100_000)
    stop = threading.Event()

    def flusher() -> None:
        while not stop.is_set():
            log.flush()

    thread = threading.Thread(target=flusher)
    thread.start()
    try:
        for i in range(5000):
            log.append(record(t=float(i)))
    finally:
        stop.set()
        thread.join()
    log.flush()
    assert [r.t for r in read_request_log(path)] == [float(i) for i in range(5000)]


@given(
    t=st.floats(0, 4e9),
    model=st.text(max_size=300),
    tokens=st.tuples(*[st.none() | st.integers(0, 2**40)] * 2),
    latency=st.floats(0, 1e4),
    ttft=st.none() | st.floats(0, 1e4),
    status=st.sampled_from([200, 400, 499, 503]),
    names=st.tuples(st.text(max_size=200), st.text(max_size=200)),
    stream=st.booleans(),
    max_tokens=st.none() | st.integers(1, 2**31),
    temperature=st.none() | st.floats(0, 2),
    endpoint=st.sampled_from(["chat", "responses", "messages", "rerank", "transcriptions"]),
    tier=st.sampled_from(["interactive", "batch"]),
)
@settings(max_examples=60, deadline=None)
def test_a_raw_trace_tuple_logs_the_same_line_as_its_trace_record(
    tmp_path_factory: pytest.TempPathFactory,
    t: float,
    model: str,
    tokens: tuple[int | None, int | None],
    latency: float,
    ttft: float | None,
    status: int,
    names: tuple[str, str],
    stream: bool,
    max_tokens: int | None,
    temperature: float | None,
    endpoint: str,
    tier: str,
) -> None:
    """The ingress hands the log tuples (cheap on the event loop): same lines as records."""
    fields = (
        t, model, *tokens, latency, ttft, status, *names, stream, max_tokens, temperature,
        endpoint, tier,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("raw") / "log.jsonl"
    log = RequestLog(path)
    log.append(fields)  # type: ignore[arg-type]
    log.append(TraceRecord(*fields))  # type: ignore[arg-type]
    assert log.flush() == 2
    raw_line, record_line = path.read_bytes().splitlines()
    assert raw_line == record_line


def test_reader_skips_a_torn_last_line_and_refuses_other_files(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = RequestLog(path)
    log.append(record())
    log.flush()
    with path.open("a") as f:
        f.write('{"v": 1, "T": 12')
    assert read_request_log(path) == [record()]
    other = tmp_path / "workload.toml"
    other.write_text('[[model]]\nname = "m"\n')
    with pytest.raises(ConfigError, match="not a fabric request log"):
        read_request_log(other)
    with pytest.raises(ConfigError, match="does not exist"):
        read_request_log(tmp_path / "missing.jsonl")


# -- workload ---------------------------------------------------------------------------------


def test_workload_summary_gives_rates_and_token_statistics() -> None:
    records = [record(t=100.0 + i, model="a", i=100 + 20 * (i % 2), o=10) for i in range(11)]
    records += [record(t=105.0, model="b", i=50, o=None)]  # tokens unknown: rate only
    records += [record(t=106.0, model="c", i=1, o=1)]
    records += [
        TraceRecord(t=107.0, model="c", input_tokens=1, output_tokens=0, latency_s=0, status=404)
    ]
    summary = workload_summary(records)
    assert set(summary) == {"a", "b", "c"}
    a = summary["a"]
    assert a["rate"] == pytest.approx(11 / 10)  # span of arrivals: 100 .. 110
    assert a["input_mean"] == pytest.approx((6 * 100 + 5 * 120) / 11)
    assert a["input_std"] == pytest.approx(20 * (6 * 5) ** 0.5 / 11)  # 20 * sqrt(p * q)
    assert (a["output_mean"], a["output_std"]) == (10.0, 0.0)
    assert summary["b"] == {
        "rate": pytest.approx(0.1),
        "input_mean": 0.0,
        "output_mean": 0.0,
        "input_std": 0.0,
        "output_std": 0.0,
    }
    assert summary["c"]["rate"] == pytest.approx(0.1), "client errors are not demand"
    assert workload_summary(records, duration_s=100.0)["a"]["rate"] == pytest.approx(0.11)
    assert workload_summary([]) == {}


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.one_of(st.none(), st.integers(1, 5000)),
            st.integers(1, 500),
            st.sampled_from([200, 200, 404, 503]),
        ),
        max_size=40,
    ),
    st.integers(1, 4),
)
@settings(max_examples=100, deadline=None)
def test_workload_sums_merged_over_ingresses_equal_one_summary(
    rows: list[tuple[str, int | None, int, int]], parts: int
) -> None:
    records = [
        TraceRecord(t=float(i), model=m, input_tokens=inp, output_tokens=out, latency_s=1.0,
                    status=status)
        for i, (m, inp, out, status) in enumerate(rows)
    ]  # fmt: skip
    split = [accounting.workload_sums(records[i::parts]) for i in range(parts)]
    merged = accounting.merge_workload_sums(split, 100.0)
    whole = accounting.workload_summary(records, duration_s=100.0)
    assert set(merged) == set(whole)
    for model, row in whole.items():
        for key, value in row.items():
            assert merged[model][key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


# -- the log's tail (the elastic controller's signals) ----------------------------------------


def test_the_tail_after_a_cursor_is_read_once_whole_lines_only_across_rotations(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.jsonl"
    assert accounting.read_request_log_after(path, "end") == ([], "0:0")  # nothing logged yet
    line_bytes = len(json.dumps(record().as_dict(), separators=(",", ":"))) + 1
    log = RequestLog(path, rotate_bytes=3 * line_bytes, keep=2)

    def write(*ts: float) -> list[TraceRecord]:
        out = [record(t=t) for t in ts]
        for r in out:
            log.append(r)
            log.flush()
        return out

    write(1.0, 2.0)
    records, cursor = accounting.read_request_log_after(path, "end")
    assert records == []  # end: what was there before does not count
    new = write(3.0)
    records, cursor = accounting.read_request_log_after(path, cursor)
    assert records == new
    assert accounting.read_request_log_after(path, cursor) == ([], cursor)  # nothing twice
    with path.open("ab") as f:  # a line being written is left for the next read
        f.write(b'{"v": 1, "T": 9.0, "M": "m", "I"')
    records, torn = accounting.read_request_log_after(path, cursor)
    assert records == [] and torn == cursor
    with path.open("ab") as f:
        f.write(b': 1, "O": 2, "latency_s": 0.5}\n')
    records, cursor = accounting.read_request_log_after(path, cursor)
    assert [(r.t, r.input_tokens) for r in records] == [(9.0, 1)]
    new = write(4.0, 5.0, 6.0, 7.0)  # rotates past the cursor's file: nothing lost
    assert path.with_name("log.jsonl.1").exists()
    records, cursor = accounting.read_request_log_after(path, cursor)
    assert records == new
    with pytest.raises(ValueError):
        accounting.read_request_log_after(path, "12:x")


def test_recent_sums_count_tokens_and_a_ttft_histogram() -> None:
    rows = [
        TraceRecord(1.0, "m", 100, 10, 1.0, ttft_s=0.2, stream=True),
        TraceRecord(2.0, "m", None, 20, 1.0, ttft_s=1.0, stream=True),
        TraceRecord(3.0, "m", 50, None, 1.0, status=503),
        TraceRecord(4.0, "m", 70, None, 0.1, status=429),  # a client error: not demand
    ]
    sums = accounting.recent_sums(rows)
    assert set(sums) == {"m"}
    m = sums["m"]
    assert (m["requests"], m["prompt_tokens"], m["prompt_known"]) == (3, 150, 2)
    assert (m["output_tokens"], m["output_known"]) == (30, 2)
    histogram = {int(k): v for k, v in m["ttft"].items()}
    assert sum(histogram.values()) == 2
    p50 = accounting.ttft_quantile(histogram, 0.5)
    p95 = accounting.ttft_quantile(histogram, 0.95)
    assert p50 is not None and 0.2 <= p50 < 0.2 * accounting.TTFT_BUCKET_FACTOR
    assert p95 is not None and 1.0 <= p95 < 1.0 * accounting.TTFT_BUCKET_FACTOR
    assert accounting.ttft_quantile({}, 0.95) is None
    assert accounting.ttft_bucket(0.0) == 0
    assert accounting.ttft_bucket(1e9) == accounting.TTFT_BUCKETS - 1


def test_the_tier_is_logged_and_lines_from_before_it_read_as_null(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = RequestLog(path)
    log.append(TraceRecord(1.0, "m", 1, 1, 0.1, endpoint="chat", tier="batch"))
    assert log.flush() == 1
    older = {"v": 1, "T": 2.0, "M": "m", "I": 1, "O": 1, "latency_s": 0.1, "endpoint": "chat"}
    with path.open("a") as f:
        f.write(json.dumps(older) + "\n")
    assert [(r.t, r.tier) for r in read_request_log(path)] == [(1.0, "batch"), (2.0, None)]


def test_batch_requests_count_as_demand_but_not_in_the_ttft_histogram() -> None:
    """A batch request's first token includes its wait for spare capacity: the latency
    objective the controller scales for is the interactive requests'."""
    rows = [
        TraceRecord(1.0, "m", 10, 5, 1.0, ttft_s=0.2, stream=True, tier="interactive"),
        TraceRecord(2.0, "m", 10, 5, 300.0, ttft_s=299.0, stream=True, tier="batch"),
        TraceRecord(3.0, "m", 10, 5, 1.0, ttft_s=0.3, stream=True),  # logged before tiers
    ]
    m = accounting.recent_sums(rows)["m"]
    assert m["requests"] == 3 and m["output_tokens"] == 15
    assert sum(m["ttft"].values()) == 2
    p95 = accounting.ttft_quantile({int(k): v for k, v in m["ttft"].items()}, 0.95)
    assert p95 is not None and p95 < 1.0
