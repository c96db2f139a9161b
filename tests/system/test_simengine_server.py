"""The simulated engine end to end: real subprocesses on 127.0.0.1 port 0, driven with httpx."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from fabricnode.simengine.__main__ import build_parser, config_from_args, main

pytestmark = pytest.mark.slow

MODEL = "llama-3-8b"
READY_TIMEOUT_S = 15.0


@dataclass
class Engine:
    proc: subprocess.Popen[str]
    url: str

    def client(self, timeout: float = 10.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def wait(self, timeout: float = 10.0) -> int:
        return self.proc.wait(timeout)


@contextmanager
def engine(*flags: str) -> Iterator[Engine]:
    cmd = [sys.executable, "-m", "fabricnode.simengine", "--model", MODEL, "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = _read_line(proc, READY_TIMEOUT_S)
        match = re.search(r"url=(\S+)", line)
        assert match, (
            f"no ready line: {line!r}; stderr: {proc.stderr.read() if proc.stderr else ''}"
        )
        yield Engine(proc, match.group(1))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    box: list[str] = []
    stdout = proc.stdout
    assert stdout is not None
    reader = threading.Thread(target=lambda: box.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else ""


def chat(max_tokens: int = 8, content: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


def sse_events(response: httpx.Response) -> list[Any]:
    events: list[Any] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric(text: str, name: str) -> float:
    match = re.search(rf'^{re.escape(name)}\{{model_name="{MODEL}"\}} (\S+)$', text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_health_models_and_version() -> None:
    with engine("--speed", "100", "--max-model-len", "4096") as e, e.client() as c:
        assert c.get("/health").status_code == 200
        models = c.get("/v1/models").json()
        assert models["object"] == "list"
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL, 4096)]
        assert c.get("/version").json()["version"].startswith("fabricnode-sim")


def test_chat_and_completions_non_stream_carry_usage_and_are_deterministic() -> None:
    with engine("--speed", "100") as e, e.client() as c:
        first = c.post("/v1/chat/completions", json=chat(8)).json()
        again = c.post("/v1/chat/completions", json=chat(8)).json()
        assert first["object"] == "chat.completion"
        assert first["choices"][0]["message"]["role"] == "assistant"
        assert first["choices"][0]["finish_reason"] == "length"
        assert first["usage"]["completion_tokens"] == 8
        assert first["usage"]["total_tokens"] == first["usage"]["prompt_tokens"] + 8
        text = first["choices"][0]["message"]["content"]
        assert len(text.split()) == 8
        assert again["choices"][0]["message"]["content"] == text
        assert again["id"] != first["id"]
        comp = c.post("/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 5})
        assert comp.status_code == 200
        assert comp.json()["object"] == "text_completion"
        assert comp.json()["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 5,
            "total_tokens": 8,
        }
        emb = c.post("/v1/embeddings", json={"model": MODEL, "input": ["x", "y"]}).json()
        assert [d["index"] for d in emb["data"]] == [0, 1]
        assert len(emb["data"][0]["embedding"]) == 64
        emb2 = c.post("/v1/embeddings", json={"input": "x"}).json()
        assert emb2["data"][0]["embedding"] == emb["data"][0]["embedding"]


def test_streamed_chat_sends_one_chunk_per_token_then_done() -> None:
    with engine("--speed", "20") as e, e.client() as c:
        plain = c.post("/v1/chat/completions", json=chat(12)).json()
        body = chat(12, stream=True, stream_options={"include_usage": True})
        with c.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = sse_events(response)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        token_chunks = [ch for ch in chunks if ch["choices"]]
        assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in token_chunks)
        assert text == plain["choices"][0]["message"]["content"]
        assert len(token_chunks) == 1 + 12
        assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12

        body = {"model": MODEL, "prompt": "one two", "max_tokens": 4, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as response:
            events = sse_events(response)
        assert events[-1] == "[DONE]"
        assert [ev["choices"][0]["finish_reason"] for ev in events[:-1]] == [None] * 3 + ["length"]


def test_stream_tokens_arrive_as_they_are_produced() -> None:
    # ~8 ms per decode step for an 8B model on an H100 at speed 1: 40 tokens take ~0.3 s.
    with engine("--speed", "1") as e, e.client() as c:
        arrivals: list[float] = []
        with c.stream(
            "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 40, "stream": True}
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
        assert len(arrivals) == 40
        assert arrivals[-1] - arrivals[0] > 0.15


def test_metrics_use_vllm_names_and_move_under_load() -> None:
    # Reserve mode: 200 KV tokens hold one 100+60 request at a time, even though identical
    # prompts share their six full blocks (two would need 96 + 2 * (4 + 60) = 224): the rest
    # wait. (Optimistic admission would run all three and preempt: see the test below.)
    flags = ("--speed", "2", "--kv-tokens", "200", "--admission", "reserve")
    with engine(*flags) as e, e.client() as c:
        text = c.get("/metrics").text
        for name in (
            "vllm:num_requests_waiting",
            "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total",
            "vllm:num_preemptions_total",
        ):
            assert metric(text, name) == 0.0
        prompt = " ".join(f"w{i}" for i in range(100))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 60}
        seen_waiting = seen_running = 0.0
        seen_usage = 0.0
        with ThreadPoolExecutor(3) as pool, e.client() as worker:
            futures = [pool.submit(worker.post, "/v1/completions", json=body) for _ in range(3)]
            while not all(f.done() for f in futures):
                text = c.get("/metrics").text
                seen_waiting = max(seen_waiting, metric(text, "vllm:num_requests_waiting"))
                seen_running = max(seen_running, metric(text, "vllm:num_requests_running"))
                seen_usage = max(seen_usage, metric(text, "vllm:kv_cache_usage_perc"))
                time.sleep(0.02)
            assert all(f.result().status_code == 200 for f in futures)
        assert seen_waiting >= 1 and seen_running == 1
        assert 0.5 < seen_usage <= 1.0
        text = c.get("/metrics").text
        assert metric(text, "vllm:num_requests_running") == 0
        assert metric(text, "vllm:prefix_cache_queries_total") == 300
        assert metric(text, "vllm:prefix_cache_hits_total") == 2 * 96  # six whole blocks, twice
        assert metric(text, "vllm:num_preemptions_total") == 0


def test_a_preempted_stream_sends_each_token_once_and_metrics_count_the_preemption() -> None:
    # 256 KV tokens (16 blocks). a (100 prompt tokens, 150 to generate) is admitted first; b (50
    # and 100) joins it while a has fewer than 92 tokens. Together they outgrow the cache before
    # either finishes, so b, the newer, is preempted, waits for a, then resumes.
    a_body = {"prompt": list(range(1000, 1100)), "max_tokens": 150}
    b_body = {"prompt": list(range(5000, 5050)), "max_tokens": 100}
    with engine("--speed", "1", "--kv-tokens", "256") as e, e.client() as c:
        with ThreadPoolExecutor(1) as pool, e.client() as worker:
            a = pool.submit(worker.post, "/v1/completions", json=a_body)
            deadline = time.monotonic() + 5.0
            while metric(c.get("/metrics").text, "vllm:num_requests_running") < 1:
                assert time.monotonic() < deadline and not a.done()
                time.sleep(0.005)
            body = {**b_body, "stream": True, "stream_options": {"include_usage": True}}
            with c.stream("POST", "/v1/completions", json=body) as response:
                events = sse_events(response)
            assert a.result().json()["usage"]["completion_tokens"] == 150
        assert events[-1] == "[DONE]"
        token_chunks = [ev for ev in events[:-1] if ev["choices"]]
        assert len(token_chunks) == 100
        reasons = [ch["choices"][0]["finish_reason"] for ch in token_chunks]
        assert reasons == [None] * 99 + ["length"]
        assert events[-2]["usage"]["completion_tokens"] == 100
        text = c.get("/metrics").text
        assert metric(text, "vllm:num_preemptions_total") >= 1
        assert metric(text, "vllm:num_requests_waiting") == 0
        # The same request alone (no preemption now) gives the same text: every token exactly
        # once, in order.
        streamed = "".join(ch["choices"][0]["text"] for ch in token_chunks)
        alone = c.post("/v1/completions", json=b_body).json()
        assert streamed == alone["choices"][0]["text"]
        assert metric(c.get("/metrics").text, "vllm:num_preemptions_total") == metric(
            text, "vllm:num_preemptions_total"
        )


def test_a_client_that_disconnects_frees_its_batch_slot() -> None:
    with engine("--speed", "0.2") as e, e.client() as c:
        body = {"prompt": "x", "max_tokens": 500, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i > 2:
                    break
        with pytest.raises(httpx.TimeoutException):
            c.post("/v1/completions", json={"prompt": "y", "max_tokens": 500}, timeout=0.2)
        deadline = time.monotonic() + 3.0
        running = -1.0
        while time.monotonic() < deadline:
            running = metric(c.get("/metrics").text, "vllm:num_requests_running")
            if running == 0:
                break
            time.sleep(0.05)
        assert running == 0


def test_errors_have_the_openai_shape() -> None:
    with engine("--speed", "100", "--max-model-len", "64") as e, e.client() as c:
        cases = [
            (c.post("/v1/chat/completions", content=b"{not json"), 400, "invalid_json"),
            (c.post("/v1/chat/completions", json={"model": MODEL}), 400, "invalid_parameter"),
            (c.post("/v1/chat/completions", json=chat(model="other")), 404, "model_not_found"),
            (c.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, None),
            (c.post("/v1/completions", json={"prompt": "x", "max_tokens": 100}), 400, None),
            (c.post("/v1/embeddings", json={"input": 5}), 400, "invalid_parameter"),
            (c.get("/v1/nope"), 404, "not_found"),
            (c.get("/v1/chat/completions"), 405, "method_not_allowed"),
        ]
        for response, status, code in cases:
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert set(error) >= {"message", "type", "code"} and error["message"]
            if code is not None:
                assert error["code"] == code
        assert "maximum context length is 64" in cases[4][0].json()["error"]["message"]
        assert c.get("/health").status_code == 200  # still serving


def test_crash_after_n_requests_exits_the_process() -> None:
    with engine("--speed", "100", "--crash-after-requests", "2") as e, e.client() as c:
        assert c.post("/v1/chat/completions", json=chat(2)).status_code == 200
        assert c.post("/v1/chat/completions", json=chat(2)).status_code == 200
        assert e.wait(5) == 3
        with pytest.raises(httpx.TransportError):
            c.get("/health")


def test_crash_after_seconds_exits_the_process() -> None:
    with engine("--crash-after-s", "0.3") as e:
        assert e.wait(5) == 3


def test_hang_stops_answering_health_until_killed() -> None:
    # The engine was serving when it printed its ready line; it hangs when its log says so
    # (a GET of /health before that raced the 0.3 s timer on a loaded machine).
    with engine("--hang-after-s", "0.3", "--shutdown-grace-s", "0.2") as e, e.client(1.0) as c:
        assert _stderr_says(e.proc, "hanging after", READY_TIMEOUT_S)
        with pytest.raises(httpx.TimeoutException):
            c.get("/health", timeout=0.3)
        assert e.proc.poll() is None
        e.proc.send_signal(signal.SIGTERM)
        assert e.wait(5) == 0


def _stderr_says(proc: subprocess.Popen[str], text: str, timeout: float) -> bool:
    """Whether a line of ``proc``'s stderr holds ``text`` within ``timeout`` seconds."""
    found = threading.Event()

    def read() -> None:
        stderr = proc.stderr
        assert stderr is not None
        for line in stderr:
            if text in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    return found.wait(timeout)


def test_error_rate_one_answers_500_but_health_stays_up() -> None:
    with engine("--error-rate", "1", "--speed", "100") as e, e.client() as c:
        response = c.post("/v1/chat/completions", json=chat(2))
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "InternalServerError"
        assert c.get("/health").status_code == 200


def test_slowdown_makes_requests_slower() -> None:
    def elapsed(*flags: str) -> float:
        with engine("--speed", "2", *flags) as e, e.client() as c:
            start = time.monotonic()
            assert (
                c.post("/v1/completions", json={"prompt": "x", "max_tokens": 30}).status_code == 200
            )
            return time.monotonic() - start

    # Ten times slower pacing against twice the time: a loaded machine adds the same fixed
    # costs (a connection, a process's wake-ups) to both, which at 4x made the ratio 1.4
    assert elapsed("--slowdown", "10") > 2 * elapsed()


def test_sigterm_lets_in_flight_requests_finish_then_exits_zero() -> None:
    with engine("--speed", "1") as e, e.client() as c, ThreadPoolExecutor(1) as pool:
        future = pool.submit(c.post, "/v1/completions", json={"prompt": "x", "max_tokens": 60})
        time.sleep(0.15)
        e.proc.send_signal(signal.SIGTERM)
        response = future.result(timeout=10)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 60
        # Well inside the 5 s grace: an idle keep-alive connection must not hold the exit up.
        assert e.wait(2) == 0


def test_bad_flags_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "m", "--gpu", "TPU"]) == 2
    assert "unknown GPU type 'TPU'" in capsys.readouterr().err
    assert main(["--model", "m", "--error-rate", "2"]) == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "m", "--admission", "eager"])
    assert exit_info.value.code == 2
    assert "--admission: invalid choice" in capsys.readouterr().err


def test_admission_flag_selects_the_mode() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args(["--model", "m"])).engine.admission == "optimistic"
    args = parser.parse_args(["--model", "m", "--admission", "reserve"])
    assert config_from_args(args).engine.admission == "reserve"


def test_openai_client_works_against_the_engine() -> None:
    openai = pytest.importorskip("openai")
    with engine("--speed", "100") as e:
        client = openai.OpenAI(base_url=e.url + "/v1", api_key="sk-none")
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.usage.completion_tokens == 4
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)


def sleep_state(text: str) -> str:
    """The ``sleep_state`` whose ``vllm:engine_sleep_state`` sample is 1."""
    found = re.findall(
        rf'^vllm:engine_sleep_state\{{model_name="{MODEL}",sleep_state="(\w+)"\}} 1\.0$', text, re.M
    )
    assert len(found) == 1, text
    return found[0]


def test_sleep_cuts_requests_frees_the_kv_cache_and_refuses_inference_until_woken() -> None:
    with engine("--speed", "0.5", "--wake-up-s", "0.5") as e, e.client() as c:
        prompt = {"model": MODEL, "prompt": "the same long prompt " * 20, "max_tokens": 2}
        assert c.post("/v1/completions", json=prompt).status_code == 200
        assert c.post("/v1/completions", json=prompt).status_code == 200
        hits = metric(c.get("/metrics").text, "vllm:prefix_cache_hits_total")
        assert hits > 0  # the second one found the first one's blocks
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
        body = {"prompt": "x", "max_tokens": 500, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(lines)  # the request is running
            assert metric(c.get("/metrics").text, "vllm:num_requests_running") == 1
            asleep = c.post("/sleep", params={"level": 1})
            assert asleep.status_code == 200
            assert asleep.json() == {"status": "sleeping", "level": 1}
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and len(rest) < 500  # cut short, still well formed
        assert c.get("/is_sleeping").json() == {"is_sleeping": True}
        page = c.get("/metrics").text
        assert sleep_state(page) == "weights_offloaded"
        assert metric(page, "vllm:num_requests_running") == 0
        assert metric(page, "vllm:num_requests_waiting") == 0
        assert metric(page, "vllm:kv_cache_usage_perc") == 0
        refused = c.post("/v1/chat/completions", json=chat(4))
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "model_sleeping"
        assert "POST /wake_up" in refused.json()["error"]["message"]
        assert c.get("/health").status_code == 200  # up, only asleep
        assert c.get("/v1/models").status_code == 200
        t0 = time.monotonic()
        woke = c.post("/wake_up")
        assert time.monotonic() - t0 >= 0.5  # the configured wake-up delay
        assert woke.status_code == 200 and woke.json()["status"] == "awake"
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
        assert sleep_state(c.get("/metrics").text) == "awake"
        assert c.post("/v1/completions", json=prompt).status_code == 200
        # the KV cache was freed: the same prompt found nothing cached
        assert metric(c.get("/metrics").text, "vllm:prefix_cache_hits_total") == hits
        t0 = time.monotonic()
        assert c.post("/wake_up").status_code == 200  # awake already: at once
        assert time.monotonic() - t0 < 0.5


def test_sleep_levels_and_methods_are_checked() -> None:
    with engine("--speed", "100", "--wake-up-s", "0") as e, e.client() as c:
        assert c.post("/sleep", params={"level": 3}).status_code == 400
        assert c.post("/sleep", params={"level": "x"}).status_code == 400
        assert c.get("/sleep").status_code == 405
        assert c.post("/is_sleeping").status_code == 405
        assert c.post("/sleep").json() == {"status": "sleeping", "level": 1}  # vLLM's default
        assert c.post("/sleep", params={"level": 2}).status_code == 200
        assert sleep_state(c.get("/metrics").text) == "discard_all"
        assert c.post("/wake_up").status_code == 200
        assert c.post("/v1/chat/completions", json=chat(2)).status_code == 200


def test_wake_up_delay_flag_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args(["--model", "m"])).wake_up_s == 3.0
    assert main(["--model", "m", "--wake-up-s", "-1"]) == 2
    assert "--wake-up-s" in capsys.readouterr().err


def test_a_streams_first_byte_comes_with_its_first_token() -> None:
    # As vLLM's: the role chunk goes out on the first iteration, once the prompt is computed.
    # An 8B model on an H100 at a tenth of real speed: ~0.6 s for this prompt, ~80 ms a step.
    prompt = " ".join(f"w{i}" for i in range(2000))
    with engine("--params-b", "8", "--speed", "0.1") as e, e.client() as c:
        body = chat(3, content=prompt, stream=True)
        start = time.monotonic()
        arrivals: list[tuple[float, dict[str, Any]]] = []
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append((time.monotonic() - start, json.loads(line[6:])))
        (role_at, role), (token_at, token) = arrivals[0], arrivals[1]
        assert role["choices"][0]["delta"]["role"] == "assistant"
        assert token["choices"][0]["delta"]["content"]
        assert role_at > 0.3, role_at
        assert token_at - role_at < 0.05


def test_the_step_log_records_each_step(tmp_path: Path) -> None:
    log_path = tmp_path / "steps.jsonl"
    flags = ("--speed", "20", "--scheduling-policy", "priority", "--step-log", str(log_path))
    with engine(*flags) as e, e.client() as c:
        assert c.post("/v1/chat/completions", json=chat(5, priority=1)).status_code == 200
        assert c.post("/v1/chat/completions", json=chat(3)).status_code == 200
    steps = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert len(steps) == 5 + 3  # one token per step, one request at a time
    first = steps[0]
    assert first["prefill_tokens"] > 0 and first["decode_tokens"] == 1
    (admitted,) = first["admitted"]
    assert admitted[0] == 1 and admitted[1] > 0 and admitted[2] >= 0  # priority, tokens, queued
    assert [len(s["admitted"]) for s in steps] == [1, 0, 0, 0, 0, 1, 0, 0]
    assert steps[5]["admitted"][0][0] == 0
    assert all(s["duration_s"] > 0 and 0 <= s["kv_usage"] <= 1 for s in steps)
    assert all(s["queued"] == 0 and s["waiting"] == [] for s in steps)
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)
