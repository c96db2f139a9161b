"""One line of the request log: what it holds (never text), records and raw tuples alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode import native
from fabricnode.dataplane.usage import usage_from_json
from fabricnode.requestlog import format as format_module
from fabricnode.requestlog.format import TraceRecord
from fabricnode.requestlog.reader import read_request_log
from fabricnode.requestlog.writer import RequestLog

PROMPT = "the secret plan is to reorganise the lab on tuesday"
ANSWER = "understood: tuesday reorganisation"
USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}


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
        "site",
    }
    assert (line["T"], line["M"], line["I"], line["O"]) == (1000.0, "m", 12, 3)
    assert not any(isinstance(v, str) and len(v) > 40 for v in line.values())


def test_client_values_smuggled_into_numeric_fields_are_not_logged(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = RequestLog(path)
    smuggled: Any = PROMPT

    def trace(**fields: Any) -> TraceRecord:
        return TraceRecord(t=1.0, model="m", output_tokens=None, latency_s=0.1, **fields)

    if native.is_compiled(format_module):
        # Compiled (fabricnode.native.COMPANIONS), the record's declared types are enforced.
        with pytest.raises(TypeError):
            trace(max_tokens=smuggled)
        with pytest.raises(TypeError):
            trace(temperature=smuggled)
        log.append(trace(input_tokens=2**80))
        assert log.flush() == 1
        assert json.loads(path.read_text())["I"] is None
        return
    # Interpreted, the declared types are not enforced: the line is what keeps the text out.
    log.append(trace(input_tokens=2**80, max_tokens=smuggled, temperature=smuggled))
    assert log.flush() == 1
    text = path.read_text()
    assert PROMPT not in text
    line = json.loads(text)
    assert (line["I"], line["max_tokens"], line["temperature"]) == (None, None, None)


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
    site=st.text(max_size=200),
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
    site: str,
) -> None:
    """The ingress hands the log tuples (cheap on the event loop): same lines as records."""
    fields = (
        t, model, *tokens, latency, ttft, status, *names, stream, max_tokens, temperature,
        endpoint, tier, site,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("raw") / "log.jsonl"
    log = RequestLog(path)
    log.append(fields)  # type: ignore[arg-type]
    log.append(TraceRecord(*fields))  # type: ignore[arg-type]
    assert log.flush() == 2
    raw_line, record_line = path.read_bytes().splitlines()
    assert raw_line == record_line


def test_the_tier_is_logged_and_lines_from_before_it_read_as_null(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = RequestLog(path)
    log.append(TraceRecord(1.0, "m", 1, 1, 0.1, endpoint="chat", tier="batch"))
    assert log.flush() == 1
    older = {"v": 1, "T": 2.0, "M": "m", "I": 1, "O": 1, "latency_s": 0.1, "endpoint": "chat"}
    with path.open("a") as f:
        f.write(json.dumps(older) + "\n")
    assert [(r.t, r.tier) for r in read_request_log(path)] == [(1.0, "batch"), (2.0, None)]


def test_the_serving_site_is_logged_and_lines_from_before_it_read_as_null(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.jsonl"
    log = RequestLog(path)
    log.append(TraceRecord(1.0, "m", 1, 1, 0.1, node="ab" * 16, site="alps"))
    log.append(TraceRecord(2.0, "m", 1, None, 0.1, status=503, site=""))  # no node served
    assert log.flush() == 2
    older = {"v": 1, "T": 3.0, "M": "m", "I": 1, "O": 1, "latency_s": 0.1, "tier": "batch"}
    with path.open("a") as f:
        f.write(json.dumps(older) + "\n")
    assert [(r.t, r.site) for r in read_request_log(path)] == [
        (1.0, "alps"),
        (2.0, ""),
        (3.0, None),
    ]
