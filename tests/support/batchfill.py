"""A batch whose every shard is answered, written straight into a store's layout
(``fabricnode.batch.store``): what an agent's worker finds when the last shard of a big batch is
done, so that it finalizes it at once. Used by the system test of large downloads and by
``bench/batch_memory.py``, which measure the finalize and download paths without running
thousands of requests through engines first.

Each result line carries ``result_bytes`` of answer text; every ``fail_every``-th line is an
error answer (400: the error file); a second worker's segment repeats some answers with another
body, which the merge must drop (the first result of each ``custom_id`` is kept). What the
output and error files must then hold is returned as their SHA-256 and size, computed while
writing, so nothing of that size is held here either.

To let agents that already run see such a batch appear whole, never half-written, fill it into
another root and ``publish`` it into theirs (renames: its files first, its directory last).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from fabricnode.batch import records
from fabricnode.batch.store import BatchStore, ShardCounts, new_batch_id, new_file_id
from fabricnode.batch.validate import validate_input


@dataclass(frozen=True)
class Filled:
    batch_id: str
    input_file_id: str
    output_sha256: str
    output_bytes: int
    error_sha256: str
    error_bytes: int
    completed: int
    failed: int


def _request(i: int, model: str) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": f"q{i}"}]}
    line = {"custom_id": f"r-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    return json.dumps(line).encode()


def _result(i: int, status: int, text: str) -> bytes:
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
    doc = {
        "id": f"batch_req_{i:024d}",
        "custom_id": f"r-{i}",
        "response": {"status_code": status, "request_id": f"req-{i}", "body": answer},
        "error": None,
    }
    return json.dumps(doc).encode()


def fill_done_batch(
    root: Path,
    *,
    lines: int,
    result_bytes: int,
    owner: str = "-",
    model: str = "m",
    shard_size: int = 128,
    fail_every: int = 50,
    now: float | None = None,
) -> Filled:
    now = time.time() if now is None else now  # the agents' clock: not expired
    store = BatchStore(root)
    store.ensure()
    data = b"\n".join(_request(i, model) for i in range(lines)) + b"\n"
    file_id = new_file_id()
    meta = records.new_file(
        file_id, owner=owner, filename="in.jsonl", purpose="batch", size=len(data), now=now
    )
    store.put_file(meta, data)
    plan = validate_input(
        data, "/v1/chat/completions", known_model=lambda m: True, shard_size=shard_size
    )
    assert not isinstance(plan, list), plan
    record = records.new_batch(
        new_batch_id(),
        owner=owner,
        endpoint="/v1/chat/completions",
        input_file_id=file_id,
        completion_window="24h",
        metadata=None,
        now=now,
    )
    batch_id = record["id"]
    store.create_batch(record)
    store.write_plan(batch_id, plan)
    out, err = hashlib.sha256(), hashlib.sha256()
    sizes = [0, 0]
    counts = [0, 0]
    text = "x" * result_bytes
    for k in range(plan.shards):
        shard_counts = [0, 0]
        with (
            store.segment_path(batch_id, k, "filler-a").open("wb") as first,
            store.segment_path(batch_id, k, "filler-b").open("wb") as second,
        ):
            for i in plan.shard_lines(k):
                failed = i % fail_every == fail_every - 1
                line = _result(i, 400 if failed else 200, text)
                first.write(line + b"\n")
                if i % 7 == 0:  # answered twice: the later answer must not be reported
                    second.write(_result(i, 200, "a second answer") + b"\n")
                (err if failed else out).update(line + b"\n")
                sizes[failed] += len(line) + 1
                shard_counts[failed] += 1
        store.mark_done(batch_id, k, ShardCounts(shard_counts[0], shard_counts[1]))
        counts[0] += shard_counts[0]
        counts[1] += shard_counts[1]
    record["status"] = records.IN_PROGRESS
    record["in_progress_at"] = int(now)
    record["request_counts"] = {"total": plan.lines, "completed": 0, "failed": 0}
    store.write_batch(record)
    return Filled(
        batch_id=batch_id,
        input_file_id=file_id,
        output_sha256=out.hexdigest(),
        output_bytes=sizes[0],
        error_sha256=err.hexdigest(),
        error_bytes=sizes[1],
        completed=counts[0],
        failed=counts[1],
    )


def publish(staging: Path, root: Path, batch_id: str) -> None:
    """Move a batch filled under ``staging`` into the store at ``root`` (same filesystem)."""
    source, target = BatchStore(staging), BatchStore(root)
    target.ensure()
    for path in sorted(source.files_dir.iterdir(), key=lambda p: p.suffix != ".jsonl"):
        path.rename(target.files_dir / path.name)
    source.batch_dir(batch_id).rename(target.batch_dir(batch_id))
