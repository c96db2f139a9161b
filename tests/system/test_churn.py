"""Churn acceptance test: real agents under steady load while agents and engines keep failing.

One ingress agent (no engine) takes every client request; a fleet of serving agents with
simulated engines (``FLEET``: two models) sits behind it, every agent with
``--restart on-failure``. Closed-loop clients keep it busy: half send non-streamed requests
(httpx), half streamed ones, parsed either by hand from the raw SSE (httpx: the exact wire
format) or by the official ``openai`` client (what users run; ``max_retries=0`` so that no
error is hidden by a client retry); two more send Responses and Messages requests in turn,
every other one streamed. Those streams are not resumed (the answer's state is on its node):
one whose node dies must end with an error event in its own format (``api_stream_broken...``).

Each of ``ROUNDS`` chaos rounds waits until the whole fleet serves again (as the ingress sees
it), starts two replacement agents, then, ``ACTION_GAP_S`` apart: kill -9 one serving agent
(its engine dies with it: parent-death signal), kill -9 the engine child of another (its agent
announces DOWN and restarts it as a new session), SIGTERM a third (graceful leave). Victims
are the busiest serving nodes of the model with the most of them, so every model keeps a
serving node and at least three nodes serve at any time. The ingress is never touched: a client
whose own ingress dies is not something the mesh can hide.

Every request is classified: ``ok`` (200 and a complete answer; a stream ends with
``data: [DONE]``), ``error_before_first_byte`` (a non-200 status or no response at all: must not
happen), ``broken_stream`` (200, then the serving node died: the stream must end with
``data: {"error": {... "code": "upstream_broken"}}`` and the terminating chunk, and the openai
client must raise ``APIError`` with that code; it must not happen here, since every model keeps a
serving node that can continue the stream), and the ways a broken response can go wrong
(``broken_without_error_event``; ``stream_with_lost_or_repeated_tokens``: a resumed stream that
is not one whole answer; and ``non_stream_body_cut``: a 200 whose JSON body was cut, which the
user guide allows but which is reported). At the end every agent leaves, and no agent
or engine process started by the test may be left running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from fabricnode.control.client import AdminClient
from fabricnode.errors import AgentApiError
from tests.support.meshload import Pid, closed_loop, engine_process, processes_of, sim_engine_args

pytestmark = pytest.mark.slow

FLEET = {"m1": 4, "m2": 3}  # serving agents per model
MODELS = tuple(FLEET)
ROUNDS = 8
ACTION_GAP_S = 1.0
SLOWDOWN = "10"  # about 30 ms per token: a 48-token stream lasts about 1.5 s
PLAIN_TOKENS = 16
STREAM_TOKENS = 48
MAX_RESTARTS = 3  # the agent's default --max-restarts
CLIENTS = {"plain": 4, "sse": 2, "openai": 2, "api": 2}  # half non-streamed, half streamed
CLIENT_TIMEOUT_S = 30.0
CONVERGE_TIMEOUT_S = 60.0

OK = "ok"
EARLY = "error_before_first_byte"
BROKEN = "broken_stream"
BAD_BREAK = "broken_without_error_event"
CUT_BODY = "non_stream_body_cut"
BAD_RESUME = "stream_with_lost_or_repeated_tokens"
# a Responses or Messages stream whose node died: not resumable (the answer's state is on that
# node); it must end with an error event in its own endpoint's format
API_BROKEN = "api_stream_broken_with_its_error_event"


@dataclass(frozen=True)
class Outcome:
    kind: str  # one of the classes above
    client: str  # plain | sse | openai, and the client's number
    model: str
    at_s: float  # when the request ended, seconds since the test started
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.at_s:6.2f}s {self.client:7} {self.model} {self.kind}: {self.detail}"


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"request {i}: " + "lorem ipsum " * 20}]


def chat_body(model: str, i: int, *, stream: bool) -> dict[str, Any]:
    tokens = STREAM_TOKENS if stream else PLAIN_TOKENS
    return {"model": model, "messages": messages(i), "max_tokens": tokens, "stream": stream}


# -- clients: one request each, classified -------------------------------------------------


def plain_request(http: httpx.Client, url: str, model: str, i: int) -> tuple[str, str]:
    try:
        with http.stream("POST", url, json=chat_body(model, i, stream=False)) as r:
            status = r.status_code
            try:
                raw = r.read()
            except httpx.HTTPError as exc:
                if status != 200:
                    return EARLY, f"status {status}, then {type(exc).__name__}"
                return CUT_BODY, f"200, then {type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:
        return EARLY, f"{type(exc).__name__}: {exc}"
    if status != 200:
        return EARLY, f"status {status}: {raw[:300]!r}"
    try:
        content = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return CUT_BODY, f"200 with a bad body: {raw[:300]!r}"
    return (OK, "") if isinstance(content, str) else (CUT_BODY, f"no content: {raw[:300]!r}")


def sse_request(http: httpx.Client, url: str, model: str, i: int) -> tuple[str, str]:
    """A stream read from the wire: httpx raises if the chunked body is not terminated."""
    events: list[str] = []
    try:
        with http.stream("POST", url, json=chat_body(model, i, stream=True)) as r:
            if r.status_code != 200:
                return EARLY, f"status {r.status_code}: {r.read()[:300]!r}"
            try:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            except httpx.HTTPError as exc:
                tail = events[-1][:200] if events else "(none)"
                return BAD_BREAK, f"{type(exc).__name__} after {len(events)} events, last {tail}"
    except httpx.HTTPError as exc:
        return EARLY, f"{type(exc).__name__}: {exc}"
    if events and events[-1] == "[DONE]" and not any('"error"' in e for e in events):
        return whole_answer([json.loads(e) for e in events[:-1]])
    last = events[-1] if events else ""
    try:
        error = json.loads(last)["error"]
    except (ValueError, KeyError, TypeError):
        return BAD_BREAK, f"ended after {len(events)} events without [DONE] or error: {last!r}"
    if error.get("code") != "upstream_broken" or "[DONE]" in events:
        return BAD_BREAK, f"unexpected error event after {len(events)} events: {last}"
    return BROKEN, f"after {len(events)} events: {error.get('message')}"


def whole_answer(docs: list[dict[str, Any]]) -> tuple[str, str]:
    """A complete stream (resumed or not) is one answer: one id, one role chunk, every token
    once (the simulated engine writes one per token), one final chunk, last."""
    ids = {d["id"] for d in docs}
    with_choices = [d["choices"][0] for d in docs if d["choices"]]
    roles = sum(1 for c in with_choices if c["delta"].get("role"))
    tokens = sum(1 for c in with_choices if c["delta"].get("content"))
    finals = [i for i, c in enumerate(with_choices) if c["finish_reason"]]
    if len(ids) != 1 or roles != 1 or tokens != STREAM_TOKENS:
        return BAD_RESUME, f"ids {ids}, {roles} role chunks, {tokens} tokens of {STREAM_TOKENS}"
    if finals != [len(with_choices) - 1]:
        return BAD_RESUME, f"final chunks at {finals} of {len(with_choices)}"
    return OK, ""


def openai_request(client: openai.OpenAI, model: str, i: int) -> tuple[str, str]:
    try:
        stream = client.chat.completions.create(
            model=model, messages=messages(i), max_tokens=STREAM_TOKENS, stream=True
        )
    except openai.APIStatusError as exc:
        return EARLY, f"status {exc.status_code}: {exc.message}"
    except openai.APIError as exc:  # connection error or timeout before the response head
        return EARLY, f"{type(exc).__name__}: {exc}"
    chunks = 0
    docs: list[dict[str, Any]] = []
    try:
        for chunk in stream:
            chunks += 1
            docs.append(chunk.model_dump())
    except (openai.APIConnectionError, openai.APIStatusError) as exc:
        return BAD_BREAK, f"{type(exc).__name__} after {chunks} chunks: {exc}"
    except openai.APIError as exc:  # the stream carried an error event
        body = exc.body if isinstance(exc.body, dict) else {}
        if body.get("code") != "upstream_broken":
            return BAD_BREAK, f"APIError after {chunks} chunks: {exc.body!r}"
        return BROKEN, f"after {chunks} chunks: {exc.message}"
    if not any(d["choices"] and d["choices"][0]["finish_reason"] for d in docs):
        return BAD_BREAK, f"stream ended after {chunks} chunks without finish_reason"
    return whole_answer(docs)


# The endpoints beyond chat, in turn: (path, body, the event that ends a whole stream, the
# one that ends a broken one)
API_CALLS = (
    ("/v1/responses", lambda m, i, stream: {
        "model": m, "input": messages(i)[0]["content"], "max_output_tokens": PLAIN_TOKENS,
        "stream": stream,
    }, "response.completed", "response.failed"),
    ("/v1/messages", lambda m, i, stream: {
        "model": m, "messages": messages(i), "max_tokens": PLAIN_TOKENS, "stream": stream,
    }, "message_stop", "error"),
)  # fmt: skip


def api_request(http: httpx.Client, url: str, model: str, i: int) -> tuple[str, str]:
    """A Responses or Messages request, streamed every other time, classified as chat's are."""
    path, body, done, failed = API_CALLS[i % 2]
    stream = (i // 2) % 2 == 1
    events: list[str] = []
    try:
        with http.stream("POST", url + path, json=body(model, i, stream)) as r:
            if r.status_code != 200:
                return EARLY, f"{path}: status {r.status_code}: {r.read()[:300]!r}"
            try:
                if not stream:
                    doc = json.loads(r.read())
                    whole = doc.get("output") if path == "/v1/responses" else doc.get("content")
                    return (OK, "") if whole else (CUT_BODY, f"{path}: {str(doc)[:300]}")
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        events.append(line[7:])
            except (httpx.HTTPError, ValueError) as exc:
                return BAD_BREAK, f"{path}: {type(exc).__name__} after {len(events)} events"
    except httpx.HTTPError as exc:
        return EARLY, f"{path}: {type(exc).__name__}: {exc}"
    if events and events[-1] == done:
        return OK, ""
    if events and events[-1] == failed:
        return API_BROKEN, f"{path}: after {len(events)} events"
    return BAD_BREAK, f"{path}: ended after {len(events)} events: {events[-3:]}"


# -- the fleet and the chaos ------------------------------------------------------------------


@dataclass
class Slot:
    """One serving agent of the fleet (its session changes when its engine restarts)."""

    name: str
    model: str
    agent: AgentProcess
    engine_kills: int = 0


class Fleet:
    """The serving agents behind ``ingress``, with what was done to them and when."""

    def __init__(self, mesh: LocalMesh, ingress: AgentProcess, t0: float) -> None:
        self.mesh = mesh
        self.ingress = ingress
        self.t0 = t0
        self.slots: list[Slot] = []
        self.serial = 0
        self.engines: set[Pid] = set()  # every engine process seen, to check none survives
        self.crashed: list[AgentProcess] = []
        self.leavers: list[AgentProcess] = []
        self.events: list[str] = []
        self.counts: Counter[str] = Counter()

    def note(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self.t0:6.2f}s {what}")

    def start(self, model: str) -> Slot:
        self.serial += 1
        name = f"{model}-{self.serial}"
        args = ["--restart", "on-failure", *sim_engine_args(model, "H100", "--slowdown", SLOWDOWN)]
        slot = Slot(name, model, self.mesh.start(name, args=args, wait=False))
        self.slots.append(slot)
        self.counts["started"] += 1
        self.note(f"start {name}")
        return slot

    def serving(self) -> dict[str, dict[str, Any]]:
        """Entries the ingress routes to (SERVING and alive), by agent name."""
        try:
            with AdminClient(self.ingress.http_url, timeout_s=5.0) as admin:
                nodes = admin.nodes(state="serving")
        except AgentApiError:
            return {}
        return {n["labels"].get("fabric.name", ""): n for n in nodes if n["liveness"] == "alive"}

    def converged(self) -> bool:
        """Every slot's agent runs and the ingress sees it serving; engines seen are recorded."""
        for slot in self.slots:
            if not slot.agent.running:
                raise AssertionError(
                    f"{slot.name} exited ({slot.agent.proc.returncode}) though nobody stopped "
                    f"it: {slot.agent.stderr_tail(5)}"
                )
            engine = engine_process(slot.agent)
            if engine is not None:
                self.engines.add(engine)
        view = self.serving()
        return all(slot.name in view for slot in self.slots)

    def pick_victims(self, round_no: int) -> list[Slot]:
        """Three distinct serving slots, each from the model that has the most healthy ones
        left (ties alternate by round), the busiest first; the engine victim (second) must
        still have restarts left."""
        view = self.serving()
        healthy = [s for s in self.slots if s.name in view]
        victims: list[Slot] = []
        for role in ("crash", "engine", "leave"):
            pool = [
                s
                for s in healthy
                if s not in victims and (role != "engine" or s.engine_kills < MAX_RESTARTS)
            ]
            left = Counter(s.model for s in healthy if s not in victims)
            models = sorted(
                {s.model for s in pool},
                key=lambda m: (left[m], (MODELS.index(m) + round_no) % len(MODELS)),
                reverse=True,
            )
            assert models and left[models[0]] >= 2, f"no safe {role} victim: {left}"
            candidates = [s for s in pool if s.model == models[0]]
            victims.append(max(candidates, key=lambda s: _busy(view[s.name])))
        return victims

    def crash(self, slot: Slot) -> None:
        engine = engine_process(slot.agent)
        if engine is not None:
            self.engines.add(engine)
        slot.agent.kill()
        self.slots.remove(slot)
        self.crashed.append(slot.agent)
        self.counts["agents killed"] += 1
        self.note(f"kill -9 agent {slot.name}")

    def kill_engine(self, slot: Slot) -> None:
        engine = engine_process(slot.agent)
        assert engine is not None, f"{slot.name} serves without an engine process"
        self.engines.add(engine)
        os.kill(engine.pid, signal.SIGKILL)
        slot.engine_kills += 1
        self.counts["engines killed"] += 1
        self.note(f"kill -9 engine {engine.pid} of {slot.name}")

    def leave(self, slot: Slot) -> None:
        slot.agent.terminate()
        self.slots.remove(slot)
        self.leavers.append(slot.agent)
        self.counts["agents left"] += 1
        self.note(f"SIGTERM agent {slot.name}")

    def describe(self) -> str:
        view = self.serving()
        states = ", ".join(
            f"{s.name}:{'serving' if s.name in view else 'not serving'}" for s in self.slots
        )
        return f"fleet {states}\nchaos:\n" + "\n".join(self.events)


def _busy(entry: dict[str, Any]) -> int:
    load = entry.get("load") or {}
    return int(load.get("running") or 0) + int(load.get("waiting") or 0)


def metric_total(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def metric_value(text: str, series: str) -> float:
    """One series (name with its labels as written) of a /metrics page; 0 when absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- the test ----------------------------------------------------------------------------------


def test_churn_under_load_gives_no_error_before_the_first_byte(mesh: LocalMesh) -> None:
    t_start = time.monotonic()
    ingress = mesh.start("ingress")
    fleet = Fleet(mesh, ingress, t_start)
    for model, count in FLEET.items():
        for _ in range(count):
            fleet.start(model)
    assert wait_until(fleet.converged, CONVERGE_TIMEOUT_S), fleet.describe()

    url = ingress.http_url
    stop = threading.Event()
    outcomes: list[Outcome] = []
    with ExitStack() as clients:
        kinds = [kind for kind, count in CLIENTS.items() for _ in range(count)]
        workers = [_worker(kind, n, url, t_start, clients) for n, kind in enumerate(kinds)]
        load_errors: list[BaseException] = []

        def load() -> None:
            try:
                outcomes.extend(closed_loop(workers, stop))
            except BaseException as exc:
                load_errors.append(exc)

        loader = threading.Thread(target=load)
        load_started = time.monotonic()
        fleet.note("load started")
        loader.start()
        try:
            for round_no in range(ROUNDS):
                assert wait_until(fleet.converged, CONVERGE_TIMEOUT_S), fleet.describe()
                crash, engine, leaver = fleet.pick_victims(round_no)
                fleet.note(f"round {round_no + 1}")
                fleet.start(crash.model)  # replacements join while the others fail
                fleet.start(leaver.model)
                fleet.crash(crash)
                time.sleep(ACTION_GAP_S)
                fleet.kill_engine(engine)
                time.sleep(ACTION_GAP_S)
                fleet.leave(leaver)
                time.sleep(ACTION_GAP_S)
            # The mesh recovers: replacements and restarted engines serve, under the same load.
            assert wait_until(fleet.converged, CONVERGE_TIMEOUT_S), fleet.describe()
            fleet.note("recovered")
        finally:
            stop.set()
            loader.join(150)
    assert not loader.is_alive(), "load threads did not finish"
    if load_errors:
        raise load_errors[0]
    load_s = time.monotonic() - load_started

    metrics = httpx.get(url + "/metrics", timeout=10).text
    retries = metric_total(metrics, "fabric_ingress_retries_total")
    ingress_broken = metric_total(metrics, "fabric_ingress_broken_streams_total")
    resumed = metric_value(metrics, 'fabric_ingress_stream_resumes_total{outcome="resumed"}')
    ingress_log = [
        line
        for line in ingress.stderr_tail(100000).splitlines()
        if re.search(r"failed before the first byte|no node could|mid-stream|continuation", line)
    ]
    # Every agent leaves; then nothing the test started may be left running. (The check sees
    # them while they run, so it is not vacuous.)
    remaining = [s.agent for s in fleet.slots] + [ingress]
    running = {a.pid for a in remaining} | {e.pid for e in map(engine_process, remaining) if e}
    seen = {p.pid for p in processes_of(mesh.workdir)}
    assert running <= seen, f"processes_of misses {running - seen}"
    codes = mesh.stop_all(timeout_s=30.0)

    def all_gone() -> bool:
        return not any(p.running() for p in fleet.engines) and not any(processes_of(mesh.workdir))

    gone = wait_until(all_gone, 15)

    by_kind = Counter(o.kind for o in outcomes)
    plain = sum(o.client.startswith("plain") for o in outcomes)
    api = sum(o.client.startswith("api") for o in outcomes)
    print(
        f"\nchurn: {len(outcomes)} requests ({plain} chat non-streamed, "
        f"{len(outcomes) - plain - api} chat streamed, {api} Responses and Messages, half of "
        f"them streamed) in {load_s:.1f} s: ok {by_kind[OK]}, errors before first byte "
        f"{by_kind[EARLY]}, broken streams {by_kind[BROKEN]} (each ended with upstream_broken), "
        f"broken without the error event {by_kind[BAD_BREAK]}, resumed with lost or repeated "
        f"tokens {by_kind[BAD_RESUME]}, cut non-streamed bodies {by_kind[CUT_BODY]}, Responses "
        f"and Messages streams broken with their own error event {by_kind[API_BROKEN]}; "
        f"streams resumed {resumed:g}; {ROUNDS} rounds: {fleet.counts['agents killed']} agents and "
        f"{fleet.counts['engines killed']} engines killed, {fleet.counts['agents left']} agents "
        f"left, {fleet.counts['started']} serving agents started; ingress retries {retries:g}, "
        f"broken responses at the ingress {ingress_broken:g}; {len(fleet.engines)} engine "
        f"processes seen; {time.monotonic() - t_start:.1f} s in all"
    )
    evidence = "\n".join(
        [*map(str, (o for o in outcomes if o.kind != OK)), *fleet.events, *ingress_log[-40:]]
    )
    assert len(outcomes) >= 100, evidence
    assert by_kind[OK] >= len(outcomes) // 2, evidence
    assert by_kind[EARLY] == 0, evidence
    assert by_kind[BAD_BREAK] == 0, evidence
    # Every model keeps a serving node, so every broken stream is resumed there, whole.
    assert by_kind[BROKEN] == 0, evidence
    assert by_kind[BAD_RESUME] == 0, evidence
    assert retries > 0 or resumed > 0, "the chaos never hit a request in flight"
    assert fleet.counts["agents killed"] == fleet.counts["engines killed"] == ROUNDS
    # Graceful leaves (during the churn and at the end) exit 0; crashes are SIGKILL.
    assert {a.name: codes[a.name] for a in fleet.leavers + remaining} == {
        a.name: 0 for a in fleet.leavers + remaining
    }
    assert {codes[a.name] for a in fleet.crashed} == {-signal.SIGKILL}
    assert gone, f"left running: {[p for p in fleet.engines if p.running()]} " + str(
        list(processes_of(mesh.workdir))
    )


def _worker(kind: str, n: int, url: str, t0: float, clients: ExitStack) -> Callable[[int], Outcome]:
    """Client ``n``: its own connection pool (one user), one request per call.

    A failed request names the outcome of the previous request on the same client, whose
    connection it may have reused.
    """
    endpoint = url + "/v1/chat/completions"
    if kind == "openai":
        oai = clients.enter_context(
            openai.OpenAI(
                base_url=url + "/v1", api_key="churn", max_retries=0, timeout=CLIENT_TIMEOUT_S
            )
        )
    else:
        timeout = httpx.Timeout(CLIENT_TIMEOUT_S, connect=10.0)
        http = clients.enter_context(httpx.Client(timeout=timeout))
    previous: list[Outcome] = []

    def one(i: int) -> Outcome:
        model = MODELS[(n + i) % len(MODELS)]
        seq = n * 100000 + i
        started = time.monotonic() - t0
        if kind == "plain":
            result, detail = plain_request(http, endpoint, model, seq)
        elif kind == "sse":
            result, detail = sse_request(http, endpoint, model, seq)
        elif kind == "api":
            result, detail = api_request(http, url, model, seq)
        else:
            result, detail = openai_request(oai, model, seq)
        if result not in (OK, BROKEN, API_BROKEN):
            before = f"{previous[-1].kind} at {previous[-1].at_s:.2f}s" if previous else "none"
            detail += f" (sent at {started:.2f}s; previous request on this client: {before})"
        outcome = Outcome(result, f"{kind}{n}", model, time.monotonic() - t0, detail)
        previous[:] = [outcome]
        return outcome

    return one
