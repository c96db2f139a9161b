"""Priority tiers with real agents and simulated engines: batch requests (``X-Fabric-Priority:
batch``) wait at the ingress until a node has room for them and are released fairly between API
keys; interactive requests never wait behind them; a node whose engine schedules by priority is
labelled so, and batch requests reach its engine with the batch priority.

One mesh for the module: ``fcfs`` serves m1 (an engine on its default policy), ``prio`` serves
m2 with ``--scheduling-policy priority``, and ``edge`` is the ingress the clients use, with API
keys on and at most two batch requests in flight per node, so that a few clients keep batch
requests waiting in its gate.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from fabricnode.dataplane.apikeys import ApiKeyStore
from fabricnode.mesh.schema import PRIORITY_SCHEDULING_LABEL
from tests.support.meshload import closed_loop, sim_engine_args
from tests.support.meshview import entry, metrics

pytestmark = pytest.mark.slow

BATCH_SLOTS = 2  # --batch-max-inflight-per-node of the ingress


@dataclass
class Mesh:
    local: LocalMesh
    fcfs: AgentProcess
    prio: AgentProcess
    edge: AgentProcess
    tokens: dict[str, str] = field(default_factory=dict)

    def headers(self, key: str, *, batch: bool) -> dict[str, str]:
        headers = {"authorization": f"Bearer {self.tokens[key]}"}
        if batch:
            headers["x-fabric-priority"] = "batch"
        return headers

    def metrics(self) -> dict[str, float]:
        return metrics(self.edge.http_url, api_key=self.tokens["ops"])

    def waiting(self, key: str) -> float:
        return self.metrics().get(f'fabric_ingress_batch_waiting{{key="{key}"}}', 0.0)


@pytest.fixture(scope="module")
def fab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("tiers")
    local = LocalMesh(work / "mesh")
    try:
        store = ApiKeyStore(work / "api-keys.json", enabled=True)
        tokens = {name: store.new_key(name)[0] for name in ("a", "b", "c")}
        tokens["ops"] = store.new_key("ops", admin=True)[0]
        store.save()
        fcfs = local.start("fcfs", args=sim_engine_args("m1", "H100"))
        prio = local.start(
            "prio", args=sim_engine_args("m2", "H100", "--scheduling-policy", "priority")
        )
        edge = local.start(
            "edge",
            args=[
                "--api-keys",
                str(work / "api-keys.json"),
                "--batch-max-inflight-per-node",
                str(BATCH_SLOTS),
            ],
        )
        mesh = Mesh(local, fcfs, prio, edge, tokens)

        def both_served() -> bool:
            try:
                listed = httpx.get(
                    edge.http_url + "/v1/models",
                    headers={"authorization": f"Bearer {tokens['ops']}"},
                    timeout=2,
                ).json()["data"]
                return {m["id"] for m in listed} == {"m1", "m2"}
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        assert wait_until(both_served, 30), "m1 and m2 never listed"
        yield mesh
    finally:
        local.close()
        for agent in local.agents:
            print(f"--- {agent.name} ---\n{agent.stderr_tail(15)}")


def chat(model: str, max_tokens: int, text: str = "hello") -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
    }


@dataclass
class Load:
    """Closed-loop batch clients per key, each sending one request at a time until stopped;
    every answer is recorded as (key, status) in arrival order."""

    mesh: Mesh
    clients: dict[str, int]
    max_tokens: int
    answers: list[tuple[str, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None
    done: list[object] = field(default_factory=list)

    def __enter__(self) -> Load:
        url = self.mesh.edge.http_url + "/v1/chat/completions"

        def worker(key: str, n: int) -> Callable[[int], None]:
            http = httpx.Client(timeout=120, headers=self.mesh.headers(key, batch=True))

            def post(i: int) -> None:
                body = chat("m1", self.max_tokens, f"{key} client {n} request {i}")
                status = http.post(url, json=body).status_code
                with self.lock:
                    self.answers.append((key, status))

            return post

        workers = [worker(k, n) for k, count in self.clients.items() for n in range(count)]
        self.thread = threading.Thread(
            target=lambda: self.done.append(closed_loop(workers, self.stop)), daemon=True
        )
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(180)
        assert self.done, "the load threads did not finish"

    def count(self) -> int:
        with self.lock:
            return len(self.answers)

    def since(self, start: int) -> list[tuple[str, int]]:
        with self.lock:
            return self.answers[start:]


def test_two_keys_get_equal_batch_completions_whatever_they_offer(fab: Mesh) -> None:
    """Key a runs ten times key b's clients (40 against 4), every request batch tier, against a
    node that takes two batch requests at a time: both keys queue in the ingress's gate, and
    while both do, each completes about as many requests as the other."""
    with Load(fab, {"a": 40, "b": 4}, max_tokens=16) as load:
        assert wait_until(lambda: fab.waiting("a") >= 20 and fab.waiting("b") >= 1, 30)
        start = load.count()
        assert wait_until(lambda: load.count() >= start + 160, 120)
        window = load.since(start)[:160]
        # still backlogged at the end of the window: the window saw both keys compete
        assert fab.waiting("a") >= 20 and fab.waiting("b") >= 1
    per_key = Counter(key for key, _ in window)
    assert {status for _, status in window} == {200}  # an fcfs engine: no priority field sent
    assert abs(per_key["a"] - per_key["b"]) <= 0.2 * max(per_key.values()), per_key
    seen = fab.metrics()
    assert seen['fabric_ingress_tier_requests_total{tier="batch"}'] >= len(window)
    assert seen['fabric_ingress_batch_admitted_total{key="a"}'] >= per_key["a"]
    assert seen["fabric_ingress_batch_wait_seconds_count"] >= len(window)
    assert wait_until(lambda: fab.waiting("a") == fab.waiting("b") == 0, 30)  # clients gone


def test_an_interactive_request_does_not_wait_behind_waiting_batch_requests(fab: Mesh) -> None:
    """With batch requests queued in the gate, an interactive request for the same model is
    answered before the gate has let through as many batch requests as were waiting when it
    arrived: it did not queue behind them."""
    with Load(fab, {"c": 12}, max_tokens=200):
        assert wait_until(lambda: fab.waiting("c") >= 8, 30)
        before = fab.metrics()
        backlog = before['fabric_ingress_batch_waiting{key="c"}']
        r = httpx.post(
            fab.edge.http_url + "/v1/chat/completions",
            json=chat("m1", 4),
            headers=fab.headers("c", batch=False),
            timeout=30,
        )
        after = fab.metrics()
    assert r.status_code == 200, r.text
    admitted = 'fabric_ingress_batch_admitted_total{key="c"}'
    assert after[admitted] - before[admitted] < backlog, (before[admitted], after[admitted])
    assert after['fabric_ingress_batch_waiting{key="c"}'] > 0
    assert after['fabric_ingress_tier_requests_total{tier="interactive"}'] >= 1


def test_streamed_prompts_teach_the_ingress_each_nodes_prefill_rate(fab: Mesh) -> None:
    """Each streamed request sent to a node with no prefill ahead of it (by the ingress's
    clock) is a sample of that node's prefill rate; /metrics shows the rate learned, by node.
    Short prompts say nothing of the rate and are not sampled."""
    name = "fabric_ingress_prefill_rate_tokens_per_second"
    series = f'{name}{{node="{fab.fcfs.session_id}"}}'
    url = fab.edge.http_url + "/v1/chat/completions"
    headers = fab.headers("a", batch=False)
    with httpx.Client(timeout=60, headers=headers) as http:
        short = chat("m1", 2, "a short prompt")
        with http.stream("POST", url, json={**short, "stream": True}) as r:
            assert r.status_code == 200
            r.read()
        assert series not in fab.metrics()
        prompt = " ".join(f"word{i}" for i in range(600))  # 4,800 bytes: 1,200 estimated tokens
        for _ in range(3):
            body = {**chat("m1", 2, prompt), "stream": True}
            with http.stream("POST", url, json=body) as r:
                assert r.status_code == 200
                assert r.headers["x-fabric-node"] == fab.fcfs.session_id
                r.read()
    rate = fab.metrics()[series]
    # The simulated H100 prefills a small model's prompt in a millisecond step; the first token
    # also waits for two agents' hops: a rate of some thousands to a few 100,000 tokens/s.
    assert 1_000 < rate < 10_000_000, rate


def test_batch_requests_reach_a_priority_engine_with_the_batch_priority(fab: Mesh) -> None:
    """prio's engine runs with --scheduling-policy priority: its entry says so, batch requests
    for it carry "priority": 1 (the default --batch-priority) and interactive ones none."""
    sid = fab.prio.session_id
    # (the edge's registry views need an admin key: the entries as fcfs, an open agent, sees them)
    prio_entry, fcfs_entry = entry(fab.fcfs, sid), entry(fab.fcfs, fab.fcfs.session_id)
    assert prio_entry is not None and fcfs_entry is not None
    assert prio_entry["labels"][PRIORITY_SCHEDULING_LABEL] == "1"
    assert PRIORITY_SCHEDULING_LABEL not in fcfs_entry["labels"]
    url = fab.edge.http_url + "/v1/chat/completions"
    for batch, n in ((True, 3), (False, 2)):
        for i in range(n):
            r = httpx.post(
                url, json=chat("m2", 2, f"{i}"), headers=fab.headers("a", batch=batch), timeout=30
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-fabric-node"] == sid
    counts = metrics(prio_entry["engine"]["url"])
    series = 'fabric_simengine_requests_by_priority_total{model_name="m2",priority="%d"}'
    assert counts[series % 1] == 3
    assert counts[series % 0] == 2


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({"x-fabric-priority": "urgent"}, 400, "invalid_header"),
        ({"x-fabric-batch-owner": "not-the-token a"}, 401, "invalid_batch_owner"),
    ],
)
def test_bad_tier_headers_are_refused_in_the_requests_dialect(
    fab: Mesh, headers: dict[str, str], status: int, code: str
) -> None:
    for path, body in (
        ("/v1/chat/completions", chat("m1", 2)),
        ("/v1/messages", {**chat("m1", 2), "max_tokens": 2}),
    ):
        r = httpx.post(
            fab.edge.http_url + path,
            json=body,
            headers={**fab.headers("a", batch=False), **headers},
            timeout=10,
        )
        assert r.status_code == status, r.text
        if path == "/v1/messages":
            assert r.json()["type"] == "error"
        else:
            assert r.json()["error"]["code"] == code


def test_the_request_log_names_each_requests_tier(fab: Mesh, tmp_path: Path) -> None:
    # The edge agent logs to its default request log under the mesh's FABRIC_HOME.
    from fabricnode.requestlog.reader import read_request_log, request_log_files

    logs = sorted((fab.local.workdir / "logs").glob("requests-*.jsonl"))
    url = fab.edge.http_url + "/v1/chat/completions"
    for batch in (True, False):
        r = httpx.post(url, json=chat("m1", 2), headers=fab.headers("b", batch=batch), timeout=30)
        assert r.status_code == 200

    def logged() -> set[str | None]:
        found = set()
        for log in sorted((fab.local.workdir / "logs").glob("requests-*.jsonl")):
            for path in request_log_files(log):
                found |= {r.tier for r in read_request_log(path) if r.key == "b"}
        return found

    assert wait_until(lambda: {"batch", "interactive"} <= logged(), 20), (logs, logged())
