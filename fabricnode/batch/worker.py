"""Working batches: every agent runs one ``BatchWorker``, and together they run every batch of
the mesh's store through the mesh's own ingress, as batch-tier requests.

What a worker does, every ``scan_interval_s`` (sooner when poked by a new batch):

* **validates** a batch in ``validating`` (one worker, under the batch's ``validate`` lease):
  ``validate.validate_input`` against the models the mesh serves or declares, then either the
  plan and ``in_progress``, or ``failed`` with the problems by line;
* **takes shards** of batches in ``in_progress`` (``shard-K`` leases of ``shard_size`` lines)
  while it has fewer lines queued than ``concurrency``, at most ``max_shards_per_batch`` per
  batch. A shard taken over from a dead or silent worker starts with the results its segments
  already hold: only the other lines run (``store``'s exactly-once rule);
* **sends** the queued lines, at most ``concurrency`` at once, to this agent's ingress over
  loopback with ``x-fabric-batch-owner: <token> <owner key id>``. The ingress treats them as
  batch-tier requests of that key: they go to a node only while it has room for batch work, and
  keys share that room fairly. Which line goes next is round robin over the owners with queued
  lines, then over their batches, so one key's many or large batches cannot crowd out another
  key's in this worker either. A line whose answer is transient (503, 429, 502, 504, no
  connection) is sent again after a backoff, until the batch is cancelled or expires; any other
  answer is its result;
* **finishes** a shard (its segment ``fsync``-ed, then ``shard-K.done`` with its counts) and,
  when every shard is done, **finalizes** the batch under its ``finalize`` lease: the output and
  error files, in input order, then ``completed``. A cancelled (or expired) batch stops taking
  shards; each worker lets the lines it already sent finish and gives its shards up; once no live
  worker holds a shard the batch is finalized as ``cancelled`` (or ``expired``, the lines that did
  not run reported ``batch_expired`` in the error file).

Leases are renewed every ``lease_ttl_s / 4``; a worker that loses one (taken over after it
stalled) drops that shard's queued lines. Filesystem calls run in worker threads.

Bounded memory: a worker never holds a whole input or output file. It keeps each batch's input
open and reads the lines of a shard when it takes it (one ranged read: ``store.read_lines``),
dropping each line once sent; it takes no more shards while the lines it holds reach
``input_buffer_bytes``. Validation reads the input as a stream of lines. Finalizing writes the
output and error files as streams, shard by shard, holding one shard's ``custom_id``s and one
result line at a time (``store.ShardResults``). Each scan writes the counts of the shards it
works to their ``progress`` files, which status polls read instead of the results.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import orjson
import trio

from fabricnode.batch import records
from fabricnode.batch.store import (
    BatchStore,
    FileWriter,
    Plan,
    ShardCounts,
    iter_lines,
    read_lines,
    result_failed,
)
from fabricnode.batch.validate import validate_lines
from fabricnode.batch.worker_config import BatchConfig
from fabricnode.dataplane.tiers import OWNER_HEADER

log = logging.getLogger("fabricnode.batch.worker")

TRANSIENT_STATUS = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class BatchWorkerStatistics:
    lines_sent: int
    lines_completed: int
    lines_failed: int
    transient_retries: int
    shards_taken: int
    shards_resumed: int  # taken with results of an earlier worker in them
    shards_lost: int
    batches_validated: int
    batches_finalized: int
    inflight: int
    queued: int
    input_bytes: int  # of the input lines held (queued, not yet sent)


@dataclass(eq=False)
class _Shard:
    batch: _Batch
    index: int
    pending: deque[int]
    lines: dict[int, bytes]  # the raw request line of each pending index
    counts: list[int]  # completed, failed (this shard's, earlier workers' included)
    fd: int
    inflight: int = 0
    lost: bool = False
    reported: tuple[int, int] = (0, 0)  # the counts in its progress file


@dataclass(eq=False)
class _Batch:
    batch_id: str
    owner: str
    endpoint: str
    input_fd: int  # the input file, open: read by range (it stays readable if deleted)
    plan: Plan
    shards: dict[int, _Shard] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    stopping: str | None = None  # "cancelled" or "expired": no new lines

    def queued(self) -> int:
        return sum(len(s.pending) for s in self.shards.values())


class BatchWorker:
    def __init__(
        self,
        store: BatchStore,
        *,
        config: BatchConfig,
        worker_id: Callable[[], str],
        ingress_url: Callable[[], str],
        owner_token: Callable[[], str],
        is_gone: Callable[[str], bool],
        known_model: Callable[[str], bool],
        wall_clock: Callable[[], float],
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.store = store
        self.transport = transport  # tests hand in httpx.MockTransport
        self.config = config
        self.worker_id = worker_id
        self.ingress_url = ingress_url
        self.owner_token = owner_token
        self.is_gone = is_gone
        self.known_model = known_model
        self.wall_clock = wall_clock
        self._batches: dict[str, _Batch] = {}
        self._finished: set[str] = set()
        self._held: dict[tuple[str, str], str] = {}  # (batch, lease name) -> holder id used
        self._poke = trio.Event()
        self._work = trio.Event()
        self._owner_turn = 0
        self._inflight = 0
        self._input_bytes = 0  # of the request lines held in shards (``_Shard.lines``)
        self._stats = dict.fromkeys(
            (
                "lines_sent",
                "lines_completed",
                "lines_failed",
                "transient_retries",
                "shards_taken",
                "shards_resumed",
                "shards_lost",
                "batches_validated",
                "batches_finalized",
            ),
            0,
        )

    def statistics(self) -> BatchWorkerStatistics:
        queued = sum(b.queued() for b in self._batches.values())
        return BatchWorkerStatistics(
            **self._stats, inflight=self._inflight, queued=queued, input_bytes=self._input_bytes
        )

    def poke(self) -> None:
        """A batch was created or cancelled here: look at the store now."""
        self._poke.set()

    # == the service =========================================================================

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        n = cfg.concurrency
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
        await trio.to_thread.run_sync(self.store.ensure)
        client = httpx.AsyncClient(limits=limits, timeout=timeout, transport=self.transport)
        async with client, trio.open_nursery() as nursery:
            nursery.start_soon(self._renew_leases)
            nursery.start_soon(self._send_lines, client, nursery)
            task_status.started()
            log.info("batch worker: up to %d requests at once, through %s", n, self.ingress_url())
            while True:
                try:
                    await self._scan()
                    await self._report_progress()
                except OSError as exc:  # the shared filesystem failed us: try again later
                    log.warning("batch store scan failed: %s", exc)
                with trio.move_on_after(cfg.scan_interval_s):
                    await self._poke.wait()
                self._poke = trio.Event()

    # == scanning the store ==================================================================

    async def _scan(self) -> None:
        store = self.store
        for batch_id in await trio.to_thread.run_sync(store.batch_ids):
            if batch_id in self._finished:
                continue
            record = await trio.to_thread.run_sync(store.read_batch, batch_id)
            if record is None:
                continue
            status = record.get("status")
            if status in records.FINAL:
                self._finished.add(batch_id)
                await self._forget(batch_id)
                continue
            if status == records.VALIDATING:
                await self._validate(record)
            elif status in (records.IN_PROGRESS, records.FINALIZING):
                await self._progress(record)

    async def _validate(self, record: dict[str, Any]) -> None:
        store = self.store
        batch_id = record["id"]
        if not await self._take(batch_id, "validate"):
            return
        try:
            fd = await trio.to_thread.run_sync(store.open_file, record["input_file_id"])
            now = self.wall_clock()
            if fd is None:
                problems: Any = [
                    {"code": "file_not_found", "message": "the input file is gone",
                     "param": "input_file_id", "line": None}
                ]  # fmt: skip
            else:
                try:
                    outcome = await trio.to_thread.run_sync(
                        lambda: validate_lines(
                            iter_lines(fd),
                            record["endpoint"],
                            known_model=self.known_model,
                            shard_size=self.config.shard_size,
                        )
                    )
                finally:
                    os.close(fd)
                if isinstance(outcome, Plan):
                    await trio.to_thread.run_sync(store.write_plan, batch_id, outcome)
                    record["status"] = records.IN_PROGRESS
                    record["in_progress_at"] = int(now)
                    record["request_counts"] = {"total": outcome.lines, "completed": 0, "failed": 0}
                    await trio.to_thread.run_sync(store.write_batch, record)
                    self._stats["batches_validated"] += 1
                    log.info("batch %s: %d requests, validated", batch_id, outcome.lines)
                    return
                problems = [p.to_json() for p in outcome]
            record["status"] = records.FAILED
            record["failed_at"] = int(now)
            record["errors"] = {"object": "list", "data": problems}
            await trio.to_thread.run_sync(store.write_batch, record)
            self._stats["batches_validated"] += 1
            log.info("batch %s failed validation (%d problems)", batch_id, len(problems))
        finally:
            await self._release(batch_id, "validate")

    async def _progress(self, record: dict[str, Any]) -> None:
        store = self.store
        batch_id = record["id"]
        batch = self._batches.get(batch_id)
        if batch is None:
            plan = await trio.to_thread.run_sync(store.read_plan, batch_id)
            if plan is None:
                return  # a validator is mid-write: the next scan sees
            fd = await trio.to_thread.run_sync(store.open_file, record["input_file_id"])
            if fd is None:
                return  # the input went: the next scan sees
            batch = _Batch(batch_id, record.get("owner", "-"), record["endpoint"], fd, plan)
            self._batches[batch_id] = batch
        now = self.wall_clock()
        if batch.stopping is None:
            if await trio.to_thread.run_sync(store.cancel_requested, batch_id) is not None:
                self._stop(batch, records.CANCELLED)
            elif now >= float(record.get("expires_at") or float("inf")):
                self._stop(batch, records.EXPIRED)
        batch.done = await trio.to_thread.run_sync(store.done_shard_ids, batch_id)
        for shard in list(batch.shards.values()):
            if shard.inflight == 0 and not shard.pending:
                await self._finish_shard(shard)  # stopped or lost while nothing was in flight
        if batch.stopping is not None:
            live = await trio.to_thread.run_sync(
                lambda: store.live_leases(batch_id, "shard-", now=now, is_gone=self.is_gone)
            )
            if live == 0:
                await self._finalize(record, batch, batch.stopping)
            return
        if len(batch.done) >= batch.plan.shards:
            await self._finalize(record, batch, records.COMPLETED)
            return
        await self._take_shards(batch)

    async def _forget(self, batch_id: str) -> None:
        """This worker is done with a batch: its input is closed."""
        batch = self._batches.pop(batch_id, None)
        if batch is None:
            return
        for shard in batch.shards.values():
            self._drop_pending(shard)
        if batch.input_fd >= 0:
            fd, batch.input_fd = batch.input_fd, -1
            await trio.to_thread.run_sync(os.close, fd)

    def _drop_pending(self, shard: _Shard) -> None:
        shard.pending.clear()
        self._input_bytes -= sum(len(raw) for raw in shard.lines.values())
        shard.lines.clear()

    def _stop(self, batch: _Batch, why: str) -> None:
        batch.stopping = why
        for shard in batch.shards.values():
            self._drop_pending(shard)
        log.info("batch %s: %s; the requests already sent finish", batch.batch_id, why)

    async def _take_shards(self, batch: _Batch) -> None:
        cfg = self.config
        plan = batch.plan
        if batch.queued() >= cfg.concurrency or len(batch.shards) >= cfg.max_shards_per_batch:
            return
        if self._input_bytes >= cfg.input_buffer_bytes:
            return  # the lines held are enough; more shards when they are sent
        # Workers start their search at different shards, so they rarely race for one lease.
        start = int.from_bytes(secrets.token_bytes(2), "big") % plan.shards
        for step in range(plan.shards):
            k = (start + step) % plan.shards
            if k in batch.done or k in batch.shards:
                continue
            if not await self._take(batch.batch_id, f"shard-{k}"):
                continue
            shard = await trio.to_thread.run_sync(self._open_shard, batch, k)
            if shard is None:
                await self._release(batch.batch_id, f"shard-{k}")
                batch.done.add(k)
                continue
            batch.shards[k] = shard
            self._input_bytes += sum(len(raw) for raw in shard.lines.values())
            self._stats["shards_taken"] += 1
            self._work.set()
            if batch.queued() >= cfg.concurrency or len(batch.shards) >= cfg.max_shards_per_batch:
                return
            if self._input_bytes >= cfg.input_buffer_bytes:
                return

    def _open_shard(self, batch: _Batch, k: int) -> _Shard | None:
        """Thread: the lines of shard ``k`` still to run (None: all ran, marked done now). Reads
        the shard's input lines by range, and only indexes the results already there."""
        store = self.store
        with store.shard_results(batch.batch_id, k) as results:
            answered = results.refs
            done = results.counts()
        counts = [done.completed, done.failed]
        pending: deque[int] = deque()
        lines: dict[int, bytes] = {}
        numbers = batch.plan.shard_lines(k)
        for i, raw in zip(numbers, read_lines(batch.input_fd, batch.plan, numbers), strict=True):
            if _custom_id(raw) not in answered:
                pending.append(i)
                lines[i] = raw
        if answered:
            self._stats["shards_resumed"] += 1
            log.info(
                "batch %s shard %d: %d lines answered by an earlier worker, %d to run",
                batch.batch_id, k, len(answered), len(pending),
            )  # fmt: skip
        if not pending:
            store.mark_done(batch.batch_id, k, ShardCounts(counts[0], counts[1]))
            return None
        path = store.segment_path(batch.batch_id, k, self.worker_id())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return _Shard(batch, k, pending, lines, counts, fd)

    # == leases ==============================================================================

    async def _take(self, batch_id: str, name: str) -> bool:
        holder = self.worker_id()
        now = self.wall_clock()
        ok = await trio.to_thread.run_sync(
            lambda: self.store.take_lease(
                batch_id, name, holder, now=now, ttl_s=self.config.lease_ttl_s, is_gone=self.is_gone
            )
        )
        if ok:
            self._held[(batch_id, name)] = holder
        return ok

    async def _release(self, batch_id: str, name: str) -> None:
        holder = self._held.pop((batch_id, name), None)
        if holder is not None:
            await trio.to_thread.run_sync(self.store.release_lease, batch_id, name, holder)

    async def _renew_leases(self) -> None:
        cfg = self.config
        while True:
            await trio.sleep(cfg.lease_ttl_s / 4)
            for (batch_id, name), holder in list(self._held.items()):
                now = self.wall_clock()
                try:
                    renew = partial(self.store.renew_lease, now=now, ttl_s=cfg.lease_ttl_s)
                    ok = await trio.to_thread.run_sync(renew, batch_id, name, holder)
                except OSError as exc:
                    log.warning("renewing lease %s of %s failed: %s", name, batch_id, exc)
                    continue
                if not ok and (batch_id, name) in self._held:
                    self._held.pop((batch_id, name), None)
                    self._lost(batch_id, name)

    def _lost(self, batch_id: str, name: str) -> None:
        batch = self._batches.get(batch_id)
        if batch is None or not name.startswith("shard-"):
            return
        shard = batch.shards.get(int(name[len("shard-") :]))
        if shard is None:
            return
        log.warning("batch %s: %s was taken over by another worker", batch_id, name)
        self._stats["shards_lost"] += 1
        shard.lost = True
        self._drop_pending(shard)
        self.poke()  # the scan closes it once nothing of it is in flight

    # == sending lines =======================================================================

    def _next_line(self) -> tuple[_Shard, bytes] | None:
        """Round robin over owners with queued lines, then over each owner's batches; the line
        leaves its shard's buffer here."""
        owners: dict[str, list[_Batch]] = {}
        for batch in self._batches.values():
            if batch.stopping is None and batch.queued():
                owners.setdefault(batch.owner, []).append(batch)
        if not owners:
            return None
        names = sorted(owners)
        self._owner_turn += 1
        batches = owners[names[self._owner_turn % len(names)]]
        batch = batches[(self._owner_turn // len(names)) % len(batches)]
        for shard in batch.shards.values():
            if shard.pending:
                raw = shard.lines.pop(shard.pending.popleft())
                self._input_bytes -= len(raw)
                return shard, raw
        return None

    async def _send_lines(self, client: httpx.AsyncClient, nursery: trio.Nursery) -> None:
        slots = trio.Semaphore(self.config.concurrency)
        while True:
            await slots.acquire()
            item = self._next_line()
            while item is None:
                await self._work.wait()
                self._work = trio.Event()
                item = self._next_line()
            shard, raw = item
            shard.inflight += 1
            self._inflight += 1
            nursery.start_soon(self._run_line, client, shard, raw, slots)

    async def _run_line(
        self, client: httpx.AsyncClient, shard: _Shard, raw: bytes, slots: trio.Semaphore
    ) -> None:
        batch = shard.batch
        try:
            result = await self._answer(client, batch, raw)
            if result is not None and not shard.lost:
                line = orjson.dumps(result) + b"\n"
                await trio.to_thread.run_sync(os.write, shard.fd, line)
                failed = result_failed(result)
                shard.counts[1 if failed else 0] += 1
                self._stats["lines_failed" if failed else "lines_completed"] += 1
        finally:
            shard.inflight -= 1
            self._inflight -= 1
            slots.release()
            if shard.inflight == 0 and not shard.pending:
                await self._finish_shard(shard)

    async def _answer(
        self, client: httpx.AsyncClient, batch: _Batch, raw: bytes
    ) -> dict[str, Any] | None:
        """Send one request line until it has a result; None if the batch stopped first."""
        cfg = self.config
        doc = orjson.loads(raw)
        body = dict(doc["body"])
        body.pop("stream", None)  # a batch result is one JSON answer
        body.pop("stream_options", None)
        content = orjson.dumps(body)
        url = self.ingress_url() + batch.endpoint
        headers = {
            "content-type": "application/json",
            OWNER_HEADER.decode(): f"{self.owner_token()} {batch.owner}",
        }
        backoff = cfg.backoff_min_s
        server_errors = 0
        while True:
            if batch.stopping is not None:
                return None
            self._stats["lines_sent"] += 1
            try:
                response = await client.post(url, content=content, headers=headers)
            except httpx.HTTPError as exc:
                status, answer, request_id = 0, str(exc) or type(exc).__name__, ""
                log.warning("batch %s: sending a request failed: %s", batch.batch_id, answer)
            else:
                status = response.status_code
                request_id = response.headers.get("x-request-id", "")
                answer = _body_of(response.content, cfg.max_response_bytes)
                if status == 500 and server_errors + 1 < cfg.max_server_errors:
                    server_errors += 1
                    status = 503  # tried again, like a transient answer
            if status and status not in TRANSIENT_STATUS:
                return _result(doc["custom_id"], status, answer, request_id)
            self._stats["transient_retries"] += 1
            await trio.sleep(backoff * (0.5 + secrets.randbelow(1000) / 1000))
            backoff = min(backoff * 2, cfg.backoff_max_s)

    async def _finish_shard(self, shard: _Shard) -> None:
        batch = shard.batch
        if batch.shards.get(shard.index) is not shard:
            return
        del batch.shards[shard.index]
        name = f"shard-{shard.index}"
        if shard.lost:
            await trio.to_thread.run_sync(self._close_shard, shard)
            return
        if batch.stopping is None:
            counts = ShardCounts(shard.counts[0], shard.counts[1])
            await trio.to_thread.run_sync(self._seal, shard, counts)
            batch.done.add(shard.index)
        else:
            await trio.to_thread.run_sync(self._close_shard, shard)
        await self._release(batch.batch_id, name)
        self.poke()  # more shards to take, or the batch to finalize

    def _seal(self, shard: _Shard, counts: ShardCounts) -> None:
        """Thread: make the shard's results durable, then say it is done."""
        os.fsync(shard.fd)
        self._close_shard(shard)
        self.store.mark_done(shard.batch.batch_id, shard.index, counts)

    def _close_shard(self, shard: _Shard) -> None:
        if shard.fd >= 0:
            os.close(shard.fd)
            shard.fd = -1

    # == finalizing ==========================================================================

    async def _finalize(self, record: dict[str, Any], batch: _Batch, final: str) -> None:
        store = self.store
        batch_id = batch.batch_id
        if not await self._take(batch_id, "finalize"):
            return
        try:
            now = self.wall_clock()
            if record["status"] != records.FINALIZING:
                record["status"] = records.FINALIZING
                record["finalizing_at"] = int(now)
                await trio.to_thread.run_sync(store.write_batch, record)
            await trio.to_thread.run_sync(self._merge, record, batch, final)
            self._stats["batches_finalized"] += 1
            self._finished.add(batch_id)
            await self._forget(batch_id)
            counts = record["request_counts"]
            log.info(
                "batch %s %s: %d completed, %d failed",
                batch_id, final, counts["completed"], counts["failed"],
            )  # fmt: skip
        finally:
            await self._release(batch_id, "finalize")

    def _merge(self, record: dict[str, Any], batch: _Batch, final: str) -> None:
        """Thread: the output and error files in input order, one result per ``custom_id``;
        then the final record. Streamed: shard by shard, its input lines read by range and its
        results by position, each line written as it is found (``FileWriter``)."""
        store = self.store
        plan = batch.plan
        batch_id = batch.batch_id
        with (
            store.file_writer(_result_file_id(batch_id, "output")) as out,
            store.file_writer(_result_file_id(batch_id, "error")) as err,
        ):
            for k in range(plan.shards):
                self._merge_shard(batch, k, final, out, err)
            now = self.wall_clock()
            owner = record.get("owner", "-")
            for writer, kind, key in ((out, "output", "output_file_id"),
                                      (err, "error", "error_file_id")):  # fmt: skip
                if not writer.lines:
                    continue
                writer.commit()
                file_id = _result_file_id(batch_id, kind)
                meta = records.new_file(
                    file_id,
                    owner=owner,
                    filename=f"{batch_id}_{kind}.jsonl",
                    purpose="batch_output",
                    size=writer.size,
                    now=now,
                )
                store.put_meta(meta)
                record[key] = file_id
        record["status"] = final
        record[f"{final}_at"] = int(now)
        if final == records.CANCELLED and record.get("cancelling_at") is None:
            asked = store.cancel_requested(batch_id)
            record["cancelling_at"] = int(asked if asked is not None else now)
        total = record["request_counts"]["total"]
        record["request_counts"] = {"total": total, "completed": out.lines, "failed": err.lines}
        store.write_batch(record)

    def _merge_shard(
        self, batch: _Batch, k: int, final: str, out: FileWriter, err: FileWriter
    ) -> None:
        """Thread: shard ``k``'s lines into the output and error files, in input order."""
        plan = batch.plan
        numbers = plan.shard_lines(k)
        with self.store.shard_results(batch.batch_id, k) as results:
            for raw in read_lines(batch.input_fd, plan, numbers):
                cid = _custom_id(raw)
                ref = results.refs.get(cid)
                if ref is not None:
                    (err if ref.failed else out).write_line(results.read(ref))
                elif final == records.EXPIRED:
                    err.write_line(orjson.dumps(_expired(cid)))
                elif final == records.COMPLETED:
                    # Every shard said it was done, so this cannot be; reported, not hidden.
                    err.write_line(orjson.dumps(_not_run(cid)))

    async def _report_progress(self) -> None:
        """The counts of the shards this worker works, to their progress files (those that
        changed): what status polls read (``store.counts``)."""
        worker = self.worker_id()
        for batch in list(self._batches.values()):
            for shard in list(batch.shards.values()):
                now = (shard.counts[0], shard.counts[1])
                if now == shard.reported or shard.lost:
                    continue
                counts = ShardCounts(now[0], now[1])
                await trio.to_thread.run_sync(
                    self.store.write_progress, batch.batch_id, shard.index, worker, counts
                )
                shard.reported = now


def _custom_id(raw: bytes) -> str:
    cid = orjson.loads(raw).get("custom_id")
    return cid if isinstance(cid, str) else ""


def _body_of(content: bytes, limit: int) -> Any:
    if len(content) > limit:
        return {"error": {"message": f"the answer was larger than {limit} bytes",
                          "type": "server_error", "code": "response_too_large"}}  # fmt: skip
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode("utf-8", "replace")


def _result(custom_id: str, status: int, body: Any, request_id: str) -> dict[str, Any]:
    return {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def _expired(custom_id: str) -> dict[str, Any]:
    return {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": custom_id,
        "response": None,
        "error": {
            "code": "batch_expired",
            "message": "This request could not be executed before the completion window expired.",
        },
    }


def _not_run(custom_id: str) -> dict[str, Any]:
    return {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": "batch_request_lost", "message": "no result was recorded for it"},
    }


def _result_file_id(batch_id: str, kind: str) -> str:
    """The same id whoever finalizes (a finalizer that died is redone, not duplicated)."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]
