"""What the mesh shows of each model's demand and load, gathered for the scaling policy.

* **Request logs.** ``WorkloadPoller.poll`` asks every alive agent what its request log gained
  since the last ask (``GET /fabric/v1/workload?after=<cursor>``: only the log's new lines are
  read) and adds the answers up per model (``ModelSums``: requests, prompt and output tokens,
  a TTFT histogram). The asks run in worker threads, a few at once: the controller's own agent
  is one of those asked, and its loop must stay free. An agent asked for the first time (or
  after a minute without an answer) is asked for a cursor at its log's end, so nothing from
  before counts. An agent that does not answer is no news: its cursor stays, and what it
  logged meanwhile is counted at its next answer.
* **Load.** ``load_sample`` reads the gossiped load (``MeshCore.loads``: KV-cache use and
  waiting requests, each agent's last report) of the model's SERVING replicas; a report older
  than ``max_age_s`` is left out.
* **TTFT.** ``TtftWindow`` keeps the polls' TTFT histograms of the last ``window_s`` and gives
  their p95 once enough first tokens were seen (streams only: a JSON answer has no first
  token).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from fabricnode.dataplane.accounting import CURSOR_END, TTFT_BUCKETS, parse_cursor, ttft_quantile
from fabricnode.elastic.policy import LoadSample
from fabricnode.errors import FabricError
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.registry import State
from fabricnode.mesh.schema import CONTROL_COUNTS, SERVICE_LABEL

log = logging.getLogger("fabricnode.elastic.signals")

WORKLOAD_PATH = "/fabric/v1/workload"
MAX_COUNT = 2**53  # counts and token sums a JSON number holds exactly


@dataclass(frozen=True)
class ModelSums:
    """One model's requests in some agents' logs (``accounting.recent_sums``, merged)."""

    requests: int = 0
    prompt_tokens: int = 0
    prompt_known: int = 0  # requests whose prompt tokens are known
    output_tokens: int = 0
    output_known: int = 0  # answered requests whose output tokens are known
    ttft: Mapping[int, int] = field(default_factory=dict)  # TTFT bucket -> first tokens

    def __add__(self, other: ModelSums) -> ModelSums:
        ttft = dict(self.ttft)
        for bucket, count in other.ttft.items():
            ttft[bucket] = ttft.get(bucket, 0) + count
        return ModelSums(
            self.requests + other.requests,
            self.prompt_tokens + other.prompt_tokens,
            self.prompt_known + other.prompt_known,
            self.output_tokens + other.output_tokens,
            self.output_known + other.output_known,
            ttft,
        )

    @property
    def prompt_tokens_estimate(self) -> int:
        """Prompt tokens of all the requests: the known ones scaled up to the requests whose
        prompt size the ingress could not tell (a stream without usage)."""
        if not self.prompt_known:
            return 0
        return round(self.prompt_tokens * self.requests / self.prompt_known)

    @classmethod
    def from_json(cls, row: Any) -> ModelSums:
        """One model's row of the endpoint's answer; ValueError if it is not one."""
        if not isinstance(row, dict):
            raise ValueError("a model's sums are not an object")
        raw = row.get("ttft", {})
        if not isinstance(raw, dict) or len(raw) > TTFT_BUCKETS:
            raise ValueError("ttft is not a histogram")
        ttft: dict[int, int] = {}
        for key in raw:
            ok = isinstance(key, str) and len(key) <= 3 and key.isascii() and key.isdigit()
            if not ok or int(key) >= TTFT_BUCKETS:
                raise ValueError(f"ttft bucket {key!r}")
            ttft[int(key)] = _count(raw, key)
        return cls(
            _count(row, "requests"),
            _count(row, "prompt_tokens"),
            _count(row, "prompt_known"),
            _count(row, "output_tokens"),
            _count(row, "output_known"),
            ttft,
        )


def _count(row: Mapping[str, Any], key: str) -> int:
    value = row.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COUNT:
        raise ValueError(f"{key} is not a count: {value!r}")
    return value


# agent HTTP URL, cursor -> (next cursor, sums per model); raises on failure
AskAfter = Callable[[str, str], tuple[str, Mapping[str, ModelSums]]]


def ask_after(url: str, cursor: str) -> tuple[str, dict[str, ModelSums]]:
    """What one agent's request log gained after ``cursor``, and the cursor after it."""
    r = httpx.get(f"{url}{WORKLOAD_PATH}", params={"after": cursor}, timeout=3.0)
    r.raise_for_status()
    doc = r.json()
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict):
        raise ValueError("not a workload answer")
    new = doc.get("cursor")
    if not isinstance(new, str):
        raise ValueError("the answer has no cursor")
    parse_cursor(new)
    return new, {str(m): ModelSums.from_json(row) for m, row in doc["models"].items()}


def agent_urls(core: MeshCore) -> list[tuple[str, str]]:
    """(session id, HTTP URL) of every agent the control plane counts (``CONTROL_COUNTS``:
    not known to be down, dead or gone)."""
    out = []
    for entry in core.entries(CONTROL_COUNTS):
        url = entry.body.addresses.http
        if url:
            out.append((entry.session_id, url))
    return out


@dataclass(frozen=True)
class Poll:
    """One poll of the agents' logs: the sums per model and how many agents answered."""

    sums: Mapping[str, ModelSums]
    asked: int
    answered: int


@dataclass
class WorkloadPoller:
    """Per-agent cursors into the request logs, and the polls that advance them."""

    ask: AskAfter = ask_after
    max_concurrent: int = 8
    forget_after_s: float = 60.0  # a cursor unanswered this long starts again at the end
    _cursors: dict[str, tuple[str, float]] = field(default_factory=dict)  # sid -> (cursor, at)

    async def poll(self, agents: Sequence[tuple[str, str]], now: float) -> Poll:
        """Ask every agent in ``agents`` (session id, URL) in worker threads (module
        docstring); ``now`` on the controller's clock, for the cursors' ages."""
        listed = {sid for sid, _ in agents}
        for sid in list(self._cursors):
            if sid not in listed or now - self._cursors[sid][1] > self.forget_after_s:
                del self._cursors[sid]
        answers: dict[str, tuple[str, Mapping[str, ModelSums]]] = {}
        limiter = trio.CapacityLimiter(self.max_concurrent)

        async def one(sid: str, url: str) -> None:
            cursor = self._cursors.get(sid, (CURSOR_END, now))[0]
            try:
                answers[sid] = await trio.to_thread.run_sync(self.ask, url, cursor, limiter=limiter)
            except (httpx.HTTPError, ValueError, FabricError) as exc:
                log.info("no request log from %s: %s", sid[:8], exc)

        async with trio.open_nursery() as nursery:
            for sid, url in agents:
                nursery.start_soon(one, sid, url)
        sums: dict[str, ModelSums] = {}
        for sid, (cursor, models) in answers.items():
            fresh = sid in self._cursors  # a first answer only places the cursor
            self._cursors[sid] = (cursor, now)
            if not fresh:
                continue
            for model, row in models.items():
                sums[model] = sums.get(model, ModelSums()) + row
        return Poll(sums, len(agents), len(answers))


def load_sample(core: MeshCore, model: str, now: float, max_age_s: float) -> LoadSample | None:
    """The gossiped load of the model's SERVING controller replicas (``fabric.service``
    label), those with a report at most ``max_age_s`` old; None when there is none."""
    kv: list[float] = []
    waiting: list[int] = []
    for entry in core.entries(CONTROL_COUNTS):
        if entry.body.state != State.SERVING or (SERVICE_LABEL, model) not in entry.body.labels:
            continue
        load = core.loads.get(entry.session_id)
        if load is None or now - load.at > max_age_s:
            continue
        kv.append(min(1.0, max(0.0, load.kv_usage)))
        waiting.append(max(0, load.waiting))
    if not kv:
        return None
    return LoadSample(tuple(kv), tuple(waiting))


@dataclass
class TtftWindow:
    """The TTFT histograms of the polls of the last ``window_s``, and their p95."""

    window_s: float = 60.0
    min_samples: int = 20  # fewer first tokens than this: no p95 (one slow stream is no trend)
    _polls: deque[tuple[float, Mapping[int, int]]] = field(default_factory=deque)

    def add(self, now: float, histogram: Mapping[int, int]) -> None:
        if histogram:
            self._polls.append((now, histogram))
        while self._polls and self._polls[0][0] <= now - self.window_s:
            self._polls.popleft()

    def p95(self, now: float) -> float | None:
        merged: dict[int, int] = {}
        for at, histogram in self._polls:
            if at > now - self.window_s:
                for bucket, count in histogram.items():
                    merged[bucket] = merged.get(bucket, 0) + count
        if sum(merged.values()) < self.min_samples:
            return None
        return ttft_quantile(merged, 0.95)
