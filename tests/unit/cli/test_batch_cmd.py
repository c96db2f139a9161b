"""`fabric batch` without agents: following a batch (progress views, an agent that stops
answering), the Batch API client against a fake transport, and the mistakes refused before
anything is sent."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

from cli.batch_cmd import (
    GIVE_UP_S,
    BarView,
    LineView,
    describe,
    errors_path,
    follow,
    problem_lines,
    view_for,
)
from cli.main import app, run
from fabricnode.batch.upload import form_parts
from fabricnode.control.client import BatchClient
from fabricnode.errors import AgentApiError

Json = dict[str, Any]
UNREACHABLE = "http://127.0.0.1:9"


def batch(status: str, completed: int = 0, failed: int = 0, total: int = 10, **extra: Any) -> Json:
    return {
        "id": "batch_1",
        "object": "batch",
        "endpoint": "/v1/chat/completions",
        "status": status,
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        "created_at": 1_800_000_000,
        "input_file_id": "file-in",
        "output_file_id": None,
        "error_file_id": None,
        "errors": None,
        **extra,
    }


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    def __init__(self) -> None:
        self.seen: list[str] = []
        self.closed = False

    def update(self, b: Json) -> None:
        self.seen.append(f"{b['status']} {b['request_counts']['completed']}")

    def close(self) -> None:
        self.closed = True


def answers(*items: Json | AgentApiError) -> Callable[[], Json]:
    queue: Iterator[Json | AgentApiError] = iter(items)

    def fetch() -> Json:
        item = next(queue)
        if isinstance(item, AgentApiError):
            raise item
        return item

    return fetch


# -- following ----------------------------------------------------------------------------------


def test_follow_polls_until_a_final_state_and_shows_every_answer() -> None:
    t, view = FakeTime(), Recorder()
    final = follow(
        answers(batch("in_progress", 3), batch("finalizing", 10), batch("completed", 10)),
        view,
        first=batch("validating", total=0),
        sleep=t.sleep,
        clock=t.clock,
    )
    assert final["status"] == "completed"
    assert view.seen == ["validating 0", "in_progress 3", "finalizing 10", "completed 10"]
    assert t.now == 3.0, "one second between looks at first"


def test_follow_retries_an_agent_that_stops_answering_for_a_while() -> None:
    t, view = FakeTime(), Recorder()
    down = AgentApiError("cannot reach the agent at http://x: connection refused")
    final = follow(
        answers(
            batch("in_progress", 1), down, down, AgentApiError("busy", 503), batch("completed")
        ),
        view,
        sleep=t.sleep,
        clock=t.clock,
    )
    assert final["status"] == "completed" and view.seen == ["in_progress 1", "completed 0"]


def test_follow_gives_up_after_a_minute_without_an_answer() -> None:
    t = FakeTime()
    down = AgentApiError("cannot reach the agent at http://x: connection refused")
    with pytest.raises(AgentApiError, match=f"connection refused \\(for {GIVE_UP_S:g} s\\)"):
        follow(answers(*[down] * 100), Recorder(), sleep=t.sleep, clock=t.clock)
    assert GIVE_UP_S <= t.now <= GIVE_UP_S + 1


@pytest.mark.parametrize("status", [401, 404])
def test_follow_stops_at_once_on_an_answer_that_will_not_change(status: int) -> None:
    t = FakeTime()
    with pytest.raises(AgentApiError):
        follow(answers(AgentApiError("no", status)), Recorder(), sleep=t.sleep, clock=t.clock)
    assert t.now == 0


def test_line_view_writes_on_each_new_state_and_periodically() -> None:
    t, out = FakeTime(), io.StringIO()
    view = LineView(out, every_s=30, clock=t.clock)
    for state, completed, at in [
        ("validating", 0, 0),
        ("in_progress", 0, 1),
        ("in_progress", 4, 10),  # within 30 s of the last line: not shown
        ("in_progress", 7, 31.5),
        ("completed", 10, 40),
    ]:
        t.now = at
        view.update(batch(state, completed, failed=1 if state == "completed" else 0))
    assert out.getvalue().splitlines() == [
        "batch_1: validating (0s)",
        "batch_1: in_progress, 0/10 done, 0 failed (1s)",
        "batch_1: in_progress, 7/10 done, 0 failed (31s)",
        "batch_1: completed, 11/10 done, 1 failed (40s)",
    ]


def test_bar_view_draws_done_of_total_on_a_terminal() -> None:
    out = io.StringIO()
    view = BarView(Console(file=out, force_terminal=True, width=100))
    view.update(batch("validating", total=0))
    view.update(batch("in_progress", 3, 1))
    view.close()
    view.close()  # closing twice is harmless (Ctrl-C, then the normal way out)
    text = out.getvalue()
    assert "batch_1 in_progress" in text and "4/10" in text and "1 failed" in text


def test_the_view_is_a_bar_only_on_a_terminal() -> None:
    assert isinstance(view_for(io.StringIO()), LineView)


def test_describe_and_problem_lines() -> None:
    failed = batch(
        "failed",
        total=0,
        failed_at=1_800_000_060,
        errors={
            "object": "list",
            "data": [
                {"code": "invalid_json_line", "message": "not JSON", "line": 2, "param": None},
                {"code": "empty_file", "message": "no request", "line": None, "param": None},
            ],
        },
        metadata={"job": "x"},
    )
    rows = dict(describe(failed, now=1_800_000_120))
    assert rows["status"] == "failed" and rows["requests"] == "none ran"
    assert rows["failed"] == "2027-01-15 08:01:00 UTC (1m00s ago)"
    assert rows["metadata"] == "job=x" and "expires" not in rows
    assert problem_lines(failed) == ["line 2: not JSON", "no request"]
    assert problem_lines(failed, "p.txt") == ["p.txt:2: not JSON", "p.txt: no request"]
    assert errors_path(Path("out/results.jsonl")) == Path("out/results.errors.jsonl")
    assert errors_path(Path("res")) == Path("res.errors.jsonl")


# -- the client ---------------------------------------------------------------------------------


def client_of(handler: Callable[[httpx.Request], httpx.Response]) -> BatchClient:
    return BatchClient("http://agent", transport=httpx.MockTransport(handler), api_key="fab-k")


def error(status: int, message: str, code: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "x", "code": code}})


def test_upload_is_a_multipart_form_with_purpose_batch() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"id": "file-1", "object": "file"})

    with client_of(handler) as client:
        assert client.upload("p.jsonl", b'{"a": 1}\n')["id"] == "file-1"
    (request,) = seen
    assert request.url.path == "/v1/files" and request.headers["authorization"] == "Bearer fab-k"
    parts = form_parts(request.content, request.headers["content-type"].encode())
    assert not isinstance(parts, str)
    assert parts["purpose"].content == b"batch"
    assert (parts["file"].filename, parts["file"].content) == ("p.jsonl", b'{"a": 1}\n')


def test_create_asks_for_the_24h_window_and_passes_metadata() -> None:
    bodies: list[Json] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=batch("validating", total=0))

    with client_of(handler) as client:
        client.create("file-1", "/v1/completions", {"k": "v"})
        client.create("file-1", "/v1/completions", None)
    assert bodies == [
        {"input_file_id": "file-1", "endpoint": "/v1/completions", "completion_window": "24h",
         "metadata": {"k": "v"}},
        {"input_file_id": "file-1", "endpoint": "/v1/completions", "completion_window": "24h"},
    ]  # fmt: skip


def test_client_errors_say_what_to_do() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/batches":
            return error(401, "missing API key", "invalid_api_key")
        if path.endswith("/content"):
            return error(404, "no file 'file-x'", "file_not_found")
        if path.startswith("/v1/batches/"):
            return error(404, f"no batch {path.rsplit('/', 1)[1]!r}", "batch_not_found")
        return error(404, f"no such endpoint: {path}", "not_found")

    with client_of(handler) as client:
        with pytest.raises(AgentApiError, match=r"give your API key \(fabric --api-key KEY") as e:
            client.batches()
        assert e.value.status == 401
        with pytest.raises(AgentApiError, match="no batch 'batch_x' at http://agent: batches"):
            client.batch("batch_x")
        with pytest.raises(AgentApiError, match="no file 'file-x' at http://agent"):
            client.download("file-x", lambda chunk: None)
        with pytest.raises(AgentApiError, match=r"does not serve the Batch API .*--http port"):
            client.upload("x", b"x")


def test_download_streams_the_content() -> None:
    content = b"".join(b'{"custom_id": "line-%d"}\n' % i for i in range(5000))

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/files/file-out/content"
        return httpx.Response(200, content=content)

    sink = io.BytesIO()
    with client_of(handler) as client:
        assert client.download("file-out", sink.write) == len(content)
    assert sink.getvalue() == content


# -- refused before anything is sent ------------------------------------------------------------


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for key in ("FABRIC_HOME", "FABRIC_AGENT", "FABRIC_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("FABRIC_HOME", str(tmp_path / "home"))
    return CliRunner()


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("What is 2+2?\n\nName a colour.\n")
    return path


def fabric(runner: CliRunner, *args: str, stdin: str | None = None) -> Any:
    return runner.invoke(app, ["--agent", UNREACHABLE, "batch", *args], input=stdin)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--output", "o.jsonl"], "--output needs --wait"),
        (["--wait", "--errors", "e.jsonl"], "--errors needs --output"),
        (["--endpoint", "/v1/responses"], "--endpoint '/v1/responses': choose"),
        (["--endpoint", "/v1/embeddings", "--max-tokens", "5"], "--max-tokens does not apply"),
        (["--metadata", "novalue"], "KEY=VALUE"),
        (["--max-tokens", "0"], "--max-tokens"),
    ],
)
def test_bad_submit_options_are_usage_errors_in_one_line(
    runner: CliRunner,
    prompts: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    expected: str,
) -> None:
    assert (
        run(["--agent", UNREACHABLE, "batch", "submit", str(prompts), "--model", "m", *args]) == 2
    )
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("fabric batch submit: error:") and expected in line


def test_prompts_without_a_model_are_a_usage_error_naming_the_lines(
    runner: CliRunner, prompts: Path
) -> None:
    result = fabric(runner, "submit", str(prompts))
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"fabric batch submit: error: {prompts}: 2 requests name no model (line 1, 3): "
        "give --model MODEL"
    )


def test_a_broken_line_stops_the_file_before_it_is_sent(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_text('ok\n{"messages": [\n["x"]\nok too\n')
    result = fabric(runner, "submit", str(path), "--model", "m")
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"fabric: error: {path}: 2 problems, nothing was sent:"
    assert lines[1].startswith(f"  {path}:2: this line starts like JSON but does not parse")
    assert lines[2].startswith(f"  {path}:3: a JSON array is not a request")
    assert "cannot reach" not in result.stderr and result.stdout == ""


def test_stdin_is_read_for_dash_and_an_unreachable_agent_is_one_line(runner: CliRunner) -> None:
    result = fabric(runner, "submit", "-", "--model", "m", stdin="a prompt\n")
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"fabric: error: cannot reach the agent at {UNREACHABLE}")


def test_a_missing_file_is_one_line(runner: CliRunner, tmp_path: Path) -> None:
    result = fabric(runner, "submit", str(tmp_path / "nope.txt"), "--model", "m")
    assert result.exit_code == 1
    assert (
        result.stderr.strip()
        == f"fabric: error: {tmp_path / 'nope.txt'}: No such file or directory"
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["list", "--limit", "0"], "--limit"),
        (["list", "--limit", "101"], "--limit"),
        (["results", "batch_1", "--json"], "--json needs --output"),
        (["status", " "], "ID is empty"),
    ],
)
def test_bad_read_options_are_usage_errors(
    runner: CliRunner, args: list[str], expected: str
) -> None:
    result = fabric(runner, *args)
    assert result.exit_code == 2 and expected in result.stderr


@pytest.mark.parametrize(
    "args", [["status", "batch_1"], ["list"], ["cancel", "batch_1"], ["results", "batch_1"]]
)
def test_every_command_reports_an_unreachable_agent_in_one_line(
    runner: CliRunner, args: list[str]
) -> None:
    result = fabric(runner, *args)
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert f"cannot reach the agent at {UNREACHABLE}" in line
