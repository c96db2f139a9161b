"""Everything the elastic controller learns from outside, and every call that may block.

The loop (``controller``) and the scalers (``demand``, ``follow``) decide; this module is where
they look and where they act on Slurm. Nothing else in ``fabricnode.elastic`` makes an HTTP
request or a worker-thread call (``slurmctl`` builds and runs Slurm's command lines, called
only from here; ``reconcile`` and ``policy`` are pure).

* **The agents' request logs, through one client.** ``AgentClient`` is the one client of the
  agents' ``GET /fabric/v1/workload`` (``WorkloadClient`` is its seam for tests). It asks in
  the endpoint's two ways, which are kept apart on purpose:

  - ``requests_in(url, window_s)``: the requests per model of the last ``window_s``, the
    demand rules' idleness check (``requests_for``). It sees the log's past: a controller that
    has just taken over knows at once whether a model was used within its ``idle_to_zero``.
  - ``after(url, cursor)``: what the log gained after a cursor (requests, tokens, TTFT
    histograms; ``ModelSums``), the scaling policy's feed (``WorkloadPoller``). Its first ask
    only places the cursor at the log's end, so the past is never counted twice.

  Answering the idleness check with cursors would change what it decides (after a takeover it
  would see no past, and scale a model used a minute ago to zero); answering the feed with
  windows would count requests twice or miss them between asks. So one client, two queries.
  An agent that does not answer is no news (``None`` from ``requests_for``, a cursor kept by
  ``WorkloadPoller``).
* **The registry.** The agents to ask (``agent_urls``), the models some ingress wants and
  the requests it holds for them (``wanted_models``, ``wanted_held``: the ``fabric.wanted*``
  labels), the replicas of the controller's jobs
  (``replicas``), their gossiped load (``load_sample``; ``busy_models``: requests in flight),
  the GPU type a model is served on (``serving_gpu_type``) and the acting controller
  (``acting_controller``). The label keys are the registry's (``mesh.schema``); which nodes
  count is its one verdict, at the control plane's level: ``MeshCore.entries(CONTROL_COUNTS)``,
  ``standing_of(entry) >=
  CONTROL_COUNTS``.
* **Slurm.** ``SlurmCalls`` runs ``slurmctl.SlurmControl`` in worker threads: the mesh's jobs
  (with the one extra question of whether a served job that ended was preempted), ``sbatch``
  and ``scancel``.
* **The planner's capacities** (``capacity``), read in a worker thread: a model path's
  config.json is read from disk.

Blocking calls run in ``trio.to_thread``: the controller's own agent is one of those asked,
and its loop must stay free.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx
import trio

from fabricnode.elastic.leader import Candidate, acting, candidate_since
from fabricnode.elastic.policy import LoadSample, ReplicaCapacity
from fabricnode.elastic.reconcile import Replica
from fabricnode.elastic.slurmctl import Job, SlurmControl, SlurmRefused
from fabricnode.elastic.vocab import Submit
from fabricnode.errors import FabricError
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.registry import State
from fabricnode.mesh.schema import (
    CONTROL_COUNTS,
    ENGINE_ERROR_LABEL,
    SERVICE_LABEL,
    SERVING_SINCE_LABEL,
    SLURM_JOB_LABEL,
    WANTED_LABEL,
    parse_wanted,
)
from fabricnode.requestlog.cursor import CURSOR_END, parse_cursor
from fabricnode.requestlog.ttft import TTFT_BUCKETS

log = logging.getLogger("fabricnode.elastic.observe")

WORKLOAD_PATH = "/fabric/v1/workload"
MAX_COUNT = 2**53  # counts and token sums a JSON number holds exactly


@dataclass(frozen=True)
class ModelSums:
    """One model's requests in some agents' logs (``requestlog.sums.recent_sums``, merged)."""

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


class WorkloadClient(Protocol):
    """The agents' ``GET /fabric/v1/workload`` (module docstring); each raises
    ``httpx.HTTPError``, ``ValueError`` or ``FabricError`` when an agent does not answer."""

    def requests_in(self, url: str, window_s: float) -> Mapping[str, float]:
        """Requests per model in one agent's request log over the last ``window_s``."""
        ...

    def after(self, url: str, cursor: str) -> tuple[str, Mapping[str, ModelSums]]:
        """What one agent's request log gained after ``cursor``, and the cursor after it."""
        ...

    def history(self, url: str, history_s: float, bin_s: float) -> History:
        """One agent's request log over the last ``history_s`` in bins of ``bin_s``."""
        ...


@dataclass(frozen=True)
class History:
    """One agent's answer to ``?history=&bin=``: the cursor after what it read, the time from
    which its kept log is complete (None: all of it), and its sums by bin start."""

    cursor: str
    covers_from: float | None
    bins: Sequence[tuple[float, Mapping[str, ModelSums]]]


@dataclass(frozen=True)
class AgentClient:
    """The one client of the agents' workload endpoint (blocking: call in a worker thread)."""

    timeout_s: float = 3.0

    def requests_in(self, url: str, window_s: float) -> dict[str, float]:
        doc = self._get(url, {"window": f"{window_s:g}"})
        models = doc.get("models") or {}
        return {str(m): float(row.get("requests", 0.0)) for m, row in models.items()}

    def after(self, url: str, cursor: str) -> tuple[str, dict[str, ModelSums]]:
        doc = self._get(url, {"after": cursor})
        if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict):
            raise ValueError("not a workload answer")
        new = doc.get("cursor")
        if not isinstance(new, str):
            raise ValueError("the answer has no cursor")
        parse_cursor(new)
        return new, {str(m): ModelSums.from_json(row) for m, row in doc["models"].items()}

    def history(self, url: str, history_s: float, bin_s: float) -> History:
        doc = self._get(url, {"history": f"{history_s:g}", "bin": f"{bin_s:g}"})
        if not isinstance(doc, dict) or not isinstance(doc.get("bins"), list):
            raise ValueError("not a workload history")
        cursor = doc.get("cursor")
        if not isinstance(cursor, str):
            raise ValueError("the answer has no cursor")
        parse_cursor(cursor)
        covers = doc.get("covers_from")
        if covers is not None and not _finite(covers):
            raise ValueError(f"covers_from is not a time: {covers!r}")
        if len(doc["bins"]) > math.ceil(history_s / bin_s) + 1:
            raise ValueError("more bins than asked for")
        bins = []
        for row in doc["bins"]:
            if not isinstance(row, dict) or not _finite(row.get("start")):
                raise ValueError("a bin without a start")
            models = row.get("models")
            if not isinstance(models, dict):
                raise ValueError("a bin without models")
            sums = {str(m): ModelSums.from_json(r) for m, r in models.items()}
            bins.append((float(row["start"]), sums))
        return History(cursor, None if covers is None else float(covers), sorted(bins))

    def _get(self, url: str, params: Mapping[str, str]) -> Any:
        r = httpx.get(f"{url}{WORKLOAD_PATH}", params=params, timeout=self.timeout_s)
        r.raise_for_status()
        return r.json()


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


async def requests_for(
    client: WorkloadClient, agents: Sequence[tuple[str, str]], model: str, window_s: float
) -> float | None:
    """Requests for ``model`` over the last ``window_s`` in the logs of ``agents`` (session id,
    URL), asked one after the other in a worker thread; None as soon as one does not answer."""
    return await trio.to_thread.run_sync(_requests_for, client, agents, model, window_s)


def _requests_for(
    client: WorkloadClient, agents: Sequence[tuple[str, str]], model: str, window_s: float
) -> float | None:
    total = 0.0
    for sid, url in agents:
        try:
            total += float(client.requests_in(url, window_s).get(model, 0.0))
        except (httpx.HTTPError, ValueError, FabricError) as exc:
            log.info("no request log from %s: %s", sid[:8], exc)
            return None
    return total


@dataclass(frozen=True)
class Poll:
    """One poll of the agents' logs: the sums per model, how many agents were asked, how many
    answered and, of those, how many were counted (a first answer only places the cursor)."""

    sums: Mapping[str, ModelSums]
    asked: int
    answered: int
    counted: int = 0
    # the first poll of a poller asked for history: per model, the sums of every agent by bin
    # start, from ``history_from`` on (every agent's log complete since), all agents answered
    history: Mapping[str, Sequence[tuple[float, ModelSums]]] = field(default_factory=dict)
    history_from: float | None = None

    @property
    def complete(self) -> bool:
        """Every agent asked was counted: the sums are all that ended since the last poll."""
        return self.asked > 0 and self.counted == self.asked


@dataclass
class WorkloadPoller:
    """Per-agent cursors into the request logs, and the polls that advance them."""

    client: WorkloadClient = field(default_factory=lambda: AgentClient())
    max_concurrent: int = 8
    forget_after_s: float = 60.0  # a cursor unanswered this long starts again at the end
    _cursors: dict[str, tuple[str, float]] = field(default_factory=dict)  # sid -> (cursor, at)
    _polled: bool = False

    async def poll(
        self, agents: Sequence[tuple[str, str]], now: float, history: tuple[float, float] = (0, 0)
    ) -> Poll:
        """Ask every agent in ``agents`` (session id, URL) in worker threads (module
        docstring); ``now`` on the controller's clock, for the cursors' ages. The first poll
        with ``history`` (seconds, bin seconds) asks for that much of each log's past by bin
        instead (``Poll.history``: what a controller that takes over replays); a first poll
        without it only places the cursors."""
        listed = {sid for sid, _ in agents}
        for sid in list(self._cursors):
            if sid not in listed or now - self._cursors[sid][1] > self.forget_after_s:
                del self._cursors[sid]
        if not self._polled and history[0] > 0:
            self._polled = True
            return await self._history(agents, now, *history)
        self._polled = True
        answers: dict[str, tuple[str, Mapping[str, ModelSums]]] = {}
        limiter = trio.CapacityLimiter(self.max_concurrent)

        async def one(sid: str, url: str) -> None:
            cursor = self._cursors.get(sid, (CURSOR_END, now))[0]
            try:
                answers[sid] = await trio.to_thread.run_sync(
                    self.client.after, url, cursor, limiter=limiter
                )
            except (httpx.HTTPError, ValueError, FabricError) as exc:
                log.info("no request log from %s: %s", sid[:8], exc)

        async with trio.open_nursery() as nursery:
            for sid, url in agents:
                nursery.start_soon(one, sid, url)
        sums: dict[str, ModelSums] = {}
        counted = 0
        for sid, (cursor, models) in answers.items():
            fresh = sid in self._cursors  # a first answer only places the cursor
            self._cursors[sid] = (cursor, now)
            if not fresh:
                continue
            counted += 1
            for model, row in models.items():
                sums[model] = sums.get(model, ModelSums()) + row
        return Poll(sums, len(agents), len(answers), counted)

    async def _history(
        self, agents: Sequence[tuple[str, str]], now: float, history_s: float, bin_s: float
    ) -> Poll:
        """The first poll: every agent's past by bin, and its cursor after it. The history is
        given only when every agent answered (a missing one would read as no demand), from the
        latest time every log is complete."""
        answers: dict[str, History] = {}
        limiter = trio.CapacityLimiter(self.max_concurrent)

        async def one(sid: str, url: str) -> None:
            try:
                answers[sid] = await trio.to_thread.run_sync(
                    self.client.history, url, history_s, bin_s, limiter=limiter
                )
            except (httpx.HTTPError, ValueError, FabricError) as exc:
                log.info("no request log history from %s: %s", sid[:8], exc)

        async with trio.open_nursery() as nursery:
            for sid, url in agents:
                nursery.start_soon(one, sid, url)
        for sid, answer in answers.items():
            self._cursors[sid] = (answer.cursor, now)
        if not agents or len(answers) < len(agents):
            return Poll({}, len(agents), len(answers))
        since = max((a.covers_from for a in answers.values() if a.covers_from is not None),
                    default=now - history_s)  # fmt: skip
        since = max(since, now - history_s)
        merged: dict[str, dict[float, ModelSums]] = {}
        for answer in answers.values():
            for start, models in answer.bins:
                if start < since:
                    continue  # a bin some log does not hold whole
                for model, row in models.items():
                    per = merged.setdefault(model, {})
                    per[start] = per.get(start, ModelSums()) + row
        history = {m: sorted(per.items()) for m, per in merged.items()}
        return Poll({}, len(agents), len(answers), 0, history, since)


def agent_urls(core: MeshCore) -> list[tuple[str, str]]:
    """(session id, HTTP URL) of every agent the control plane counts (``CONTROL_COUNTS``:
    not known to be down, dead or gone)."""
    out = []
    for entry in core.entries(CONTROL_COUNTS):
        url = entry.body.addresses.http
        if url:
            out.append((entry.session_id, url))
    return out


def wanted_held(core: MeshCore) -> dict[str, int]:
    """Model -> requests held for it by the agents the control plane counts
    (``CONTROL_COUNTS``), from their ``fabric.wanted*`` labels (``mesh.schema.parse_wanted``:
    each agent's count per model bounded, the largest of its labels; summed over agents)."""
    out: dict[str, int] = {}
    for entry in core.entries(CONTROL_COUNTS):
        mine: dict[str, int] = {}
        for key, value in entry.body.labels:
            if key.startswith(WANTED_LABEL):
                for model, n in parse_wanted(value).items():
                    mine[model] = max(mine.get(model, 0), n)
        for model, n in mine.items():
            out[model] = out.get(model, 0) + n
    return out


def wanted_models(core: MeshCore) -> set[str]:
    """Models some agent the control plane counts (``CONTROL_COUNTS``) holds requests for (its
    ``fabric.wanted*`` labels)."""
    return set(wanted_held(core))


def replicas(core: MeshCore) -> list[Replica]:
    """The controller's replicas as the registry shows them (entries labelled
    ``fabric.service``, matched to jobs by their ``slurm.job_id`` label): one is alive while
    its standing is at least ``CONTROL_COUNTS`` (``mesh.schema``: not DOWN, LEFT or dead in
    this agent's view); the engine's error from the ``fabric.engine_error`` label, when it
    first served from ``fabric.serving_since``."""
    out = []
    for entry in core.registry:
        labels = dict(entry.body.labels)
        model = labels.get(SERVICE_LABEL)
        if not model:
            continue
        alive = core.standing_of(entry) >= CONTROL_COUNTS
        out.append(
            Replica(
                entry.session_id,
                model,
                labels.get(SLURM_JOB_LABEL, ""),
                entry.body.state.name.lower(),
                alive,
                labels.get(ENGINE_ERROR_LABEL, ""),
                _unix_time(labels.get(SERVING_SINCE_LABEL)),
            )
        )
    return out


def _unix_time(value: str | None) -> float | None:
    """A label's unix time, None when absent or not a plausible one."""
    try:
        at = float(value) if value else math.nan
    except ValueError:
        return None
    return at if math.isfinite(at) and at > 0 else None


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


def busy_models(core: MeshCore, now: float, max_age_s: float) -> set[str]:
    """Models with a controller replica (``fabric.service``) the control plane counts whose
    gossiped load, at most ``max_age_s`` old, has requests running, waiting or in flight at
    its agent: in demand now, whether or not any request has ended yet."""
    out: set[str] = set()
    for entry in core.entries(CONTROL_COUNTS):
        model = next((v for k, v in entry.body.labels if k == SERVICE_LABEL), "")
        if not model or model in out:
            continue
        load = core.loads.get(entry.session_id)
        if load is None or now - load.at > max_age_s:
            continue
        if load.running > 0 or load.waiting > 0 or load.inflight > 0:
            out.add(model)
    return out


def serving_gpu_type(core: MeshCore, model: str) -> str:
    """The GPU type of a SERVING replica of ``model`` ("" when none serves)."""
    for entry in core.registry:
        body = entry.body
        if body.state == State.SERVING and (SERVICE_LABEL, model) in body.labels:
            return body.hardware.gpu_type or ""
    return ""


def acting_controller(core: MeshCore) -> Candidate | None:
    """The acting controller by ``core``'s registry and liveness view (``leader.acting``)."""
    out = []
    for entry in core.registry:
        since = candidate_since(entry.body.labels)
        if since is None:
            continue
        dead = core.standing_of(entry) < CONTROL_COUNTS
        out.append(Candidate(entry.session_id, since, dead, entry.body.addresses.http))
    return acting(out)


@dataclass
class SlurmCalls:
    """The controller's Slurm calls, each in a worker thread."""

    slurm: SlurmControl
    _preempted: dict[str, bool] = field(default_factory=dict)  # ended served job -> preempted

    async def jobs(self, served: AbstractSet[str], draining: Mapping[str, float]) -> list[Job]:
        """The mesh's jobs as squeue lists them; a job that ``served`` and ended on its own
        (not ``draining`` by our cancel) shows PREEMPTED when Slurm preempted it."""
        jobs = await trio.to_thread.run_sync(self.slurm.list_jobs)
        return await trio.to_thread.run_sync(self._preemptions, jobs, served, draining)

    async def submit(self, s: Submit) -> str:
        """The new job's id; ``SlurmRefused`` with sbatch's words."""
        return await trio.to_thread.run_sync(self.slurm.submit, s)

    async def cancel(self, job_id: str, hard: bool) -> None:
        await trio.to_thread.run_sync(self.slurm.cancel, job_id, hard)

    def _preemptions(
        self, jobs: list[Job], served: AbstractSet[str], draining: Mapping[str, float]
    ) -> list[Job]:
        """A served job that ended on its own, not by our cancel, may have been preempted
        though squeue says COMPLETED (it left within the grace time): ask Slurm once per job,
        so that its replacement says why."""
        listed = {j.job_id for j in jobs}
        for job_id in [k for k in self._preempted if k not in listed]:
            del self._preempted[job_id]
        out = []
        for j in jobs:
            if (
                j.state in ("COMPLETED", "COMPLETING", "CANCELLED")
                and j.job_id in served
                and j.job_id not in draining
            ):
                if j.job_id not in self._preempted:
                    try:
                        self._preempted[j.job_id] = self.slurm.preempted(j.job_id)
                    except SlurmRefused as exc:
                        log.info("cannot tell whether job %s was preempted: %s", j.job_id, exc)
                        self._preempted[j.job_id] = False
                if self._preempted[j.job_id]:
                    j = replace(j, state="PREEMPTED")
            out.append(j)
        return out


# (model or model path, GPU type, GPUs per replica) -> the planner's capacity, or None
CapacityOf = Callable[[str, str, int], ReplicaCapacity | None]


async def capacity(capacity_of: CapacityOf, key: tuple[str, str, int]) -> ReplicaCapacity | None:
    """The planner's capacity for ``key``, in a worker thread (a config.json on disk)."""
    return await trio.to_thread.run_sync(capacity_of, *key)
