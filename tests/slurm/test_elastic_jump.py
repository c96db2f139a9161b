"""Scale by need on a real Slurm (tests/support/slurmcluster.py): a model at min 1 / max 5 whose
load jumps from one replica's capacity to four within 10 s gets its replicas in one or two
controller passes (``fabric services --json`` shows them), and 99% of the requests sent once
they are SERVING meet the TTFT objective.

Its own Slurm with six GPUs: the elastic tests' cluster has four, which would stop the fleet at
four replicas of four replicas' load (every one of them saturated, no objective met); six leave
the five the need asks for and one to spare.

Timings are printed (run with ``-s``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.elasticmesh import (
    FABRIC,
    Elastic,
    controller_jobs,
    elastic_mesh,
    serving_count,
)
from tests.support.meshview import fabric
from tests.support.slurmcluster import SlurmCluster, SlurmClusterConfig, throwaway_cluster

pytestmark = pytest.mark.slow

MODEL = "jump"
# One replica runs 6 requests at once, of 32 output tokens, ~9 s each: it saturates at ~0.65
# requests/s. The load: that, then four times as much within 10 s.
ENGINE = (
    "{fabric} sim-engine --model {{model}} --gpu H100 --port {{port}} --slowdown 100 "
    "--max-num-seqs 6"
)
TOKENS = 32
BASE_RPS = 0.65
# The objective: a 32-token answer takes ~9 s here, and the requests queued on the first replica
# before the others came wait tens of seconds; on a quiet machine the new fleet's first tokens
# are all within 2 s, but make test runs this beside three other lanes, which slows the
# simulated engines' pacing (first tokens up to 4.5 s at p50 1.6 s in such a run): 5 s.
OBJECTIVE_S = 5.0
SERVICE = """
[limits]
max_jobs = 6
max_gpus = 6

[[model]]
name = "jump"
engine = "{engine}"
gpus_per_replica = 1
min_replicas = 1
max_replicas = 5
ttft_p95 = "5s"
scale_in_hold = "10m"
hold_requests = "2m"
partitions = ["high"]
time_limit = "10:00"
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with throwaway_cluster(tmp_path_factory, SlurmClusterConfig(gpus=6)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def elastic(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Elastic]:
    with elastic_mesh(cluster, tmp_path_factory.mktemp("jump")) as elastic:
        yield elastic


@dataclass
class Asked:
    """One request: when it was sent, its time to first token, how it ended."""

    sent: float
    ttft: float | None = None
    outcome: str = ""


def ask_timed(url: str, asked: Asked, i: int) -> None:
    """A streamed request; its first event's time (the first token) and outcome."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}],
            "max_tokens": TOKENS, "stream": True}  # fmt: skip
    try:
        with (
            httpx.Client(base_url=url, timeout=180) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            if r.status_code != 200:
                asked.outcome = str(r.status_code)
                return
            for line in r.iter_lines():
                if asked.ttft is None and line.startswith("data:") and "[DONE]" not in line:
                    asked.ttft = time.monotonic() - asked.sent
            asked.outcome = "ok" if asked.ttft is not None else "empty"
    except httpx.HTTPError as exc:
        asked.outcome = type(exc).__name__


def scale_out_passes(decisions: list[dict[str, object]], since: float) -> list[tuple[str, int]]:
    """The model's submits after ``since`` (wall clock), one entry per controller pass: its
    reason (a pass's submits share it) and how many jobs it submitted."""
    passes: list[tuple[str, int]] = []
    for d in decisions:
        if d["model"] != MODEL or d["action"] != "submit" or float(str(d["at"])) < since:
            continue
        reason = str(d["reason"])
        if passes and passes[-1][0] == reason:
            passes[-1] = (reason, passes[-1][1] + 1)
        else:
            passes.append((reason, 1))
    return passes


class OpenLoop:
    """Requests at ``rate(t)`` per second whatever happens (open loop), each on a thread."""

    def __init__(self, url: str, rate: Callable[[float], float]) -> None:
        self.url, self.rate = url, rate
        self.asked: list[Asked] = []
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()
        self.sender = threading.Thread(target=self._send, daemon=True)

    def _send(self) -> None:
        start = last = time.monotonic()
        owed = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            owed += self.rate(now - start) * (now - last)
            last = now
            while owed >= 1.0:
                owed -= 1.0
                a = Asked(time.monotonic())
                self.asked.append(a)
                t = threading.Thread(
                    target=ask_timed, args=(self.url, a, len(self.asked)), daemon=True
                )
                t.start()
                self.threads.append(t)
            time.sleep(0.02)

    def finish(self) -> None:
        self.stop.set()
        self.sender.join(10)
        for t in self.threads:
            t.join(timeout=180)


def test_a_load_jump_to_four_replicas_capacity_gets_them_in_one_or_two_passes(
    cluster: SlurmCluster, elastic: Elastic, tmp_path: Path
) -> None:
    """One replica serving, its load at its saturation; within 10 s it quadruples. The
    controller learns what a replica sustains (a saturated one shows it) and asks for what the
    need says in one or two passes; of the requests sent once the fleet it asked for serves,
    99% meet the TTFT objective."""
    mesh, ingress = elastic.mesh, elastic.ingress
    service = tmp_path / "jump.toml"
    service.write_text(SERVICE.format(engine=ENGINE.format(fabric=FABRIC)))
    assert fabric(mesh, ingress, "services", "apply", str(service)).returncode == 0
    t0 = time.monotonic()

    def one_serving() -> bool:  # exactly one replica, nothing else of the model in the queue
        jobs = [j for j, _, tag in controller_jobs(cluster) if tag.model == MODEL]
        return len(jobs) == 1 and serving_count(ingress.http_url, MODEL) == 1

    while not one_serving():
        assert time.monotonic() - t0 < 90, cluster.squeue()
        time.sleep(0.5)
    base_s = 30.0  # the controller's forecast sees a few polls of the base load
    jump_s = 10.0

    def rate(t: float) -> float:
        return BASE_RPS * (1 + 3 * min(1.0, max(0.0, t - base_s) / jump_s))

    load = OpenLoop(ingress.http_url, rate)
    began = time.monotonic()
    load.sender.start()
    try:
        while time.monotonic() - began < base_s:
            time.sleep(0.5)
        jump_at, jump_wall = time.monotonic(), time.time()
        # the saturated base load may already have had a second replica added
        had = len([j for j, _, tag in controller_jobs(cluster) if tag.model == MODEL])
        # five: what the need asks for at the policy's target utilisation (max_replicas)
        while (serving_count(ingress.http_url, MODEL) or 0) < 5:
            assert time.monotonic() - jump_at < 150, cluster.squeue()
            time.sleep(0.5)
        serving_at = time.monotonic()
        # the measure: what is sent from now on, 45 s of it (~117 requests: one late first
        # token, which a loaded machine may cause, is within the 1% the objective allows)
        while time.monotonic() - serving_at < 45.0:
            time.sleep(0.5)
    finally:
        load.finish()
    doc = json.loads(fabric(mesh, ingress, "services", "--json").stdout)
    passes = scale_out_passes(doc["decisions"], jump_wall)
    after = [a for a in load.asked if a.sent >= serving_at]
    within = [a for a in after if a.outcome == "ok" and (a.ttft or 1e9) <= OBJECTIVE_S]
    outcomes = Counter(a.outcome for a in load.asked)
    ttfts = sorted(a.ttft for a in after if a.ttft is not None)
    share = len(within) / max(1, len(after))
    print(
        f"jump: 5 replicas SERVING {serving_at - jump_at:.1f} s after the jump began; {had} "
        f"jobs at the jump, scale-out passes after {passes}; of {len(after)} requests sent after, "
        f"{share:.1%} within {OBJECTIVE_S:g} s (TTFT p50 "
        f"{ttfts[len(ttfts) // 2] if ttfts else 0:.2f} s, max {ttfts[-1] if ttfts else 0:.2f} s); "
        f"all {len(load.asked)} requests: {dict(outcomes)}; test {time.monotonic() - t0:.0f} s"
    )
    assert set(outcomes) == {"ok"}, outcomes
    wanted = 5 - had  # the replicas the jump needs come in the first two passes after it
    jobs = 0
    for i, (_, n) in enumerate(passes):
        jobs += n
        if jobs >= wanted:
            assert i <= 1, passes
            break
    else:
        raise AssertionError(f"fewer than {wanted} replicas submitted after the jump: {passes}")
    assert passes[0][0].split(":")[0] in ("backlog", "load", "forecast", "objective"), passes
    missed = [(round(a.sent - serving_at, 1), round(a.ttft or -1, 2)) for a in after
              if a not in within]  # fmt: skip
    print(f"jump: missed (sent after SERVING s, TTFT s): {missed}")
    assert len(after) >= 90 and len(within) >= 0.99 * len(after), missed
