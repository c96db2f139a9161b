"""The batch worker against a fake ingress (httpx.MockTransport) and a real store in a
temporary directory: transient answers are retried, error answers go to the error file,
a shard left half-done by a dead worker is finished without running its answered lines
again, and an expired batch reports what did not run."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any
from unittest.mock import patch

import httpx
import trio

from fabricnode.batch import records
from fabricnode.batch import store as store_module
from fabricnode.batch.store import BatchStore, ShardCounts
from fabricnode.batch.worker import BatchWorker
from fabricnode.batch.worker_config import BatchConfig
from fabricnode.dataplane.tiers import OWNER_HEADER
from tests.support.batchfill import fill_done_batch


class FakeIngress:
    """Answers chat requests; the first ``busy`` requests get 503, a body whose content
    says ``bad`` gets 400. Records every request's owner header and content."""

    def __init__(self, busy: int = 0) -> None:
        self.busy = busy
        self.seen: list[str] = []
        self.owners: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.owners.add(request.headers[OWNER_HEADER.decode()])
        assert "stream" not in body
        if self.busy > 0:
            self.busy -= 1
            return httpx.Response(503, json={"error": {"message": "busy"}})
        text = body["messages"][0]["content"]
        self.seen.append(text)
        if "bad" in text:
            return httpx.Response(400, json={"error": {"message": "bad request"}})
        return httpx.Response(200, json={"choices": [{"message": {"content": "ok " + text}}]})


def make_batch(store: BatchStore, texts: list[str], *, now: float, owner: str = "k1") -> str:
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "stream": True,
                  "messages": [{"role": "user", "content": text}]}}
        for i, text in enumerate(texts)
    ]  # fmt: skip
    content = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()
    file_id = "file-" + "f" * 24
    store.put_file(
        records.new_file(
            file_id, owner=owner, filename="in.jsonl", purpose="batch", size=len(content), now=now
        ),
        content,
    )
    record = records.new_batch(
        "batch_" + "b" * 24,
        owner=owner,
        endpoint="/v1/chat/completions",
        input_file_id=file_id,
        completion_window="24h",
        metadata=None,
        now=now,
    )
    store.create_batch(record)
    return str(record["id"])


def worker(
    store: BatchStore, ingress: FakeIngress, *, wid: str = "w1", now: float = 1000.0
) -> BatchWorker:
    return BatchWorker(
        store,
        config=BatchConfig(concurrency=4, shard_size=3, scan_interval_s=0.05, backoff_min_s=0.01),
        worker_id=lambda: wid,
        ingress_url=lambda: "http://ingress",
        owner_token=lambda: "tok",
        is_gone=lambda holder: holder == "dead",
        known_model=lambda model: model == "m",
        wall_clock=lambda: now,
        transport=httpx.MockTransport(ingress),
    )


async def run_until_final(store: BatchStore, batch_id: str, w: BatchWorker) -> dict[str, Any]:
    async with trio.open_nursery() as nursery:
        await nursery.start(w.run)
        with trio.fail_after(20):
            while (record := store.read_batch(batch_id)) is None or (
                record["status"] not in records.FINAL
            ):
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    return record


def lines_of(store: BatchStore, file_id: str | None) -> list[dict[str, Any]]:
    data = store.read_file(file_id) if file_id else b""
    return [json.loads(line) for line in (data or b"").splitlines() if line.strip()]


async def test_transient_answers_are_retried_and_errors_go_to_the_error_file(
    tmp_path: Path,
) -> None:
    store = BatchStore(tmp_path)
    texts = [f"q{i}" for i in range(7)] + ["bad one"]
    batch_id = make_batch(store, texts, now=1000.0)
    ingress = FakeIngress(busy=5)
    record = await run_until_final(store, batch_id, worker(store, ingress))
    assert record["status"] == "completed"
    assert record["request_counts"] == {"total": 8, "completed": 7, "failed": 1}
    out = lines_of(store, record["output_file_id"])
    err = lines_of(store, record["error_file_id"])
    assert [r["custom_id"] for r in out] == [f"c{i}" for i in range(7)]
    assert [(r["custom_id"], r["response"]["status_code"]) for r in err] == [("c7", 400)]
    assert ingress.owners == {"tok k1"}
    assert sorted(ingress.seen) == sorted(texts)  # the 503s were sent again, nothing twice
    assert "owner" not in records.public_batch(record, None, None)


async def test_a_shard_left_by_a_dead_worker_runs_only_its_unanswered_lines(
    tmp_path: Path,
) -> None:
    store = BatchStore(tmp_path)
    batch_id = make_batch(store, [f"q{i}" for i in range(6)], now=1000.0)
    # a first worker validated, took shard 0, answered c0 and c1, and died writing c2
    async with trio.open_nursery() as nursery:
        first = worker(store, FakeIngress(), wid="dead")
        await first._scan()  # validates
        nursery.cancel_scope.cancel()
    assert store.read_plan(batch_id) is not None
    assert store.take_lease(batch_id, "shard-0", "dead", now=1000.0, ttl_s=60,
                            is_gone=lambda h: False)  # fmt: skip
    answered = [
        {"id": "batch_req_1", "custom_id": c, "error": None,
         "response": {"status_code": 200, "request_id": "", "body": {"earlier": True}}}
        for c in ("c0", "c1")
    ]  # fmt: skip
    segment = store.segment_path(batch_id, 0, "dead")
    segment.write_bytes(
        b"".join(json.dumps(a).encode() + b"\n" for a in answered) + b'{"id": "batch_req_2", "cu'
    )
    ingress = FakeIngress()
    record = await run_until_final(store, batch_id, worker(store, ingress, wid="w2"))
    assert record["status"] == "completed"
    assert sorted(ingress.seen) == ["q2", "q3", "q4", "q5"]  # c0 and c1 did not run again
    out = lines_of(store, record["output_file_id"])
    assert Counter(r["custom_id"] for r in out) == Counter(f"c{i}" for i in range(6))
    assert out[0]["response"]["body"] == {"earlier": True}


async def test_an_expired_batch_reports_the_lines_that_did_not_run(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    batch_id = make_batch(store, [f"q{i}" for i in range(5)], now=1000.0)
    async with trio.open_nursery() as nursery:
        await worker(store, FakeIngress())._scan()  # validated at t=1000
        nursery.cancel_scope.cancel()
    later = 1000.0 + records.COMPLETION_WINDOWS["24h"] + 1
    ingress = FakeIngress()
    record = await run_until_final(store, batch_id, worker(store, ingress, now=later))
    assert record["status"] == "expired" and record["expired_at"] == int(later)
    assert ingress.seen == []
    err = lines_of(store, record["error_file_id"])
    assert [r["error"]["code"] for r in err] == ["batch_expired"] * 5
    assert record["output_file_id"] is None


async def test_a_batch_cancelled_before_it_ran_ends_cancelled_with_nothing_run(
    tmp_path: Path,
) -> None:
    store = BatchStore(tmp_path)
    batch_id = make_batch(store, [f"q{i}" for i in range(5)], now=1000.0)
    store.request_cancel(batch_id, 1000.0)
    ingress = FakeIngress()
    async with trio.open_nursery() as nursery:
        w = worker(store, ingress)
        await w._scan()  # validates
        nursery.cancel_scope.cancel()
    record = await run_until_final(store, batch_id, worker(store, ingress))
    assert record["status"] == "cancelled" and record["cancelled_at"] is not None
    assert ingress.seen == [] and record["request_counts"]["completed"] == 0


async def test_finalize_streams_first_results_in_input_order_with_bounded_reads(
    tmp_path: Path,
) -> None:
    """The merge of a batch whose shards are all done: the first result of each custom_id,
    in input order, errors apart; written as a stream, every read of the store at most one
    chunk, one shard's input or one result line (never the input, a segment or the output)."""
    filled = fill_done_batch(tmp_path, lines=300, result_bytes=2000, shard_size=16)
    store = BatchStore(tmp_path)
    reads: list[int] = []
    real_pread = os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        reads.append(n)
        return real_pread(fd, n, offset)

    def whole_file(*args: object) -> bytes:
        raise AssertionError("a whole file was read")

    with (
        patch.object(store_module, "CHUNK_BYTES", 4096),
        patch.object(os, "pread", pread),
        patch.object(BatchStore, "read_file", whole_file),
    ):
        record = await run_until_final(store, filled.batch_id, worker(store, FakeIngress()))
    assert record["status"] == "completed"
    assert record["request_counts"] == {
        "total": 300, "completed": filled.completed, "failed": filled.failed
    }  # fmt: skip
    output = store.read_file(record["output_file_id"]) or b""
    errors = store.read_file(record["error_file_id"]) or b""
    assert hashlib.sha256(output).hexdigest() == filled.output_sha256
    assert hashlib.sha256(errors).hexdigest() == filled.error_sha256
    ids = [json.loads(line)["custom_id"] for line in output.splitlines()]
    assert ids == [f"r-{i}" for i in range(300) if i % 50 != 49]
    assert store.file_meta(record["output_file_id"])["bytes"] == len(output)  # type: ignore[index]
    assert len(output) > 500_000 and max(reads) <= 4096


async def test_status_counts_come_from_the_workers_progress_files(tmp_path: Path) -> None:
    """Polls never read results: they read what each worker reports of its shards (earlier
    workers' answers included) at every scan."""
    store = BatchStore(tmp_path)
    batch_id = make_batch(store, [f"q{i}" for i in range(6)], now=1000.0)
    w = worker(store, FakeIngress())
    await w._scan()  # validates
    answered = [
        {"id": "batch_req_1", "custom_id": c, "error": None,
         "response": {"status_code": status, "request_id": "", "body": {}}}
        for c, status in (("c0", 200), ("c1", 400))
    ]  # fmt: skip
    store.segment_path(batch_id, 0, "dead").write_bytes(
        b"".join(json.dumps(a).encode() + b"\n" for a in answered)
    )
    plan = store.read_plan(batch_id)
    await w._scan()  # takes shards; nothing is sent (the sender does not run here)
    assert store.counts(batch_id, plan) == ShardCounts(0, 0)
    await w._report_progress()
    assert store.counts(batch_id, plan) == ShardCounts(1, 1)
    held = w.statistics()
    assert held.queued == 4 and held.input_bytes > 0  # only the unanswered lines are held
